"""The OpenAI-compatible HTTP front door (aiohttp on the gRPC server's event
loop): ``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``,
``/health`` and ``/metrics``, ending in the same engine ``submit``/``abort``
and the same validation (``service.api.wire``) as the gRPC service."""
