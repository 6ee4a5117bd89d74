"""The models room: Slipstream's Llama-family forward pass over the paged KV
cache, and the model store (default models, local checkpoints).

Must not import the wire (grpc, ``slipstream.v1``), ``engine``, ``api``,
``telemetry`` or ``cli``.
"""
