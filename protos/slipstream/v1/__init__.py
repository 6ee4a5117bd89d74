"""Slipstream wire contract v1: stubs generated from ``inference.proto`` by
``protos/generate.py`` (``make protos``), and the bounds the contract's
well-known types set, which the server and the clients both check against."""

# google.protobuf.Duration's range, ±10,000 years, in seconds: the bound of
# every timeout on the wire (clients.wire checks arguments against it, the
# server the Durations it receives).
MAX_DURATION_S = 315_576_000_000

# Trailing metadata of a call that ended with a rejection (a GenerateOne's,
# or a whole call refused): its reason, and the retry hint a Generate
# stream's Finished.retry_after_ms carries.
REJECT_REASON_KEY = "slipstream-reject-reason"
RETRY_AFTER_KEY = "slipstream-retry-after-ms"
