"""The telemetry room: tracing set-up, request traces, metrics and logging;
it watches the engine through the observer hook.

Must not import torch, ``kernels``, ``models``, the wire (``slipstream.v1``) or ``api``.
"""
