"""The API room: the gRPC server, servicer, per-stream sessions, wire
conversion, the status table, the server's lifecycle, tenants (``auth``) and
TLS (``tls``).

Speaks protobuf and engine events, never tensors: must not import torch,
``kernels``, ``models`` or the engine's implementation (its types only).
"""
