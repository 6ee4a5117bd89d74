"""What one caller may ask of the server: sizes checked before any work is
done, and the bounds of each stream's outbound buffer. One frozen dataclass,
built from ``serve``'s flags at the entry point (``--max-prompt-bytes``, ...).

Every limit fails the request alone with INVALID_ARGUMENT and a message
naming the limit, except ``max_message_bytes``, which gRPC enforces: a
message over it ends its call (a whole stream) RESOURCE_EXHAUSTED. None of
them ends the server.
"""

from __future__ import annotations

from dataclasses import dataclass

MiB = 2**20


class OverLimit(ValueError):
    """A request over one of the limits. ``field`` names the ``Submit`` field
    at fault (``prompt``, ``stop_sequences``, ``trace_context``), so each
    front door can name its own parameter."""

    def __init__(self, message: str, field: str) -> None:
        super().__init__(message)
        self.field = field


@dataclass(frozen=True, slots=True)
class Limits:
    # gRPC's own cap on one message, in either direction (grpc.max_*_message_length).
    max_message_bytes: int = 16 * MiB
    # Text prompt (or chat contents together), in UTF-8 bytes, checked before
    # tokenizing: tokenizing costs about 3 µs a byte on a slow core.
    max_prompt_bytes: int = 4 * MiB
    # Echoed in every event of the request.
    max_request_id_bytes: int = 128
    max_stop_sequences: int = 16
    max_stop_sequence_bytes: int = 256
    # Entries of Submit.trace_context, and UTF-8 bytes of its keys and values together.
    max_trace_context_entries: int = 8
    max_trace_context_bytes: int = 4096
    # A constraint's text (JSON schema or regex), in UTF-8 bytes, checked
    # before it is compiled: compiling costs up to a second for a large schema.
    max_constraint_bytes: int = 64 * 1024
    # Choices one HTTP request may ask for (its ``n`` times its prompts): each
    # is an engine request of its own.
    max_choices: int = 16
    # A stream's buffer of events its client has not read yet. When either
    # bound is reached the stream's requests are paused (kept, not decoded)
    # until the client reads half of it; ``slow_reader_grace_s`` later they
    # are cancelled with FINISH_REASON_SLOW_READER.
    max_outbox_events: int = 4096
    max_outbox_bytes: int = 4 * MiB
    slow_reader_grace_s: float = 30.0
    # Tokenization (and chat rendering) of prompts over ``inline_prompt_bytes``
    # and every Tokenize call run on this many worker threads, with at most
    # ``max_queued_prompts`` waiting; beyond that a submit is rejected QUEUE_FULL.
    num_tokenizer_workers: int = 1
    max_queued_prompts: int = 64
    inline_prompt_bytes: int = 16 * 1024
    # Inputs at least this large are tokenized on a worker of their own at the
    # lowest CPU priority, which returns freed memory to the system afterwards
    # (malloc_trim).
    trim_after_bytes: int = 1 * MiB
    # Open HTTP connections; past it a new one is closed as soon as it is
    # accepted. ``serve`` lowers it to half the open-file limit where that
    # is lower, so the HTTP front cannot take gRPC's file descriptors.
    max_http_connections: int = 1024
    # An HTTP request's headers must all arrive within this long of its
    # connection opening (or of its last answer: an idle connection is
    # closed then too), and its body within this long of its headers (408).
    # Above the 60 s idle timeout of common load balancers.
    http_read_timeout_s: float = 75.0

    def __post_init__(self) -> None:
        for name in (
            "max_message_bytes",
            "max_prompt_bytes",
            "max_request_id_bytes",
            "max_outbox_events",
            "max_outbox_bytes",
            "num_tokenizer_workers",
            "max_choices",
            "max_http_connections",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1")
        for name in (
            "max_stop_sequences",
            "max_stop_sequence_bytes",
            "max_trace_context_entries",
            "max_trace_context_bytes",
            "max_constraint_bytes",
            "max_queued_prompts",
            "inline_prompt_bytes",
            "trim_after_bytes",
        ):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must not be negative")
        for name in ("slow_reader_grace_s", "http_read_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive")
