"""The engine room: the step loop, the model runner, engine events and config,
the cost-model calibration, the detokenizer and the observer hook.

Owns one thread that owns the model and the KV pools. Must not import the wire
(grpc, ``slipstream.v1``), ``api``, ``telemetry`` or ``cli``.
"""
