"""The API room: the gRPC server, servicer, per-stream sessions, wire
conversion, the status table and the server's lifecycle.

Speaks protobuf and engine events, never tensors: must not import torch,
``kernels``, ``models`` or the engine's implementation (its types only).
"""
