"""A request's output constraint compiled off the event loop, for both front
doors: compiling a JSON schema or a regular expression for the model's
tokenizer (service/engine/grammar.py) takes from a millisecond to a second,
and the first one builds the tokenizer's tables (1 s for 49,152 tokens).

    event loop                                worker thread (the tokenizer pool's)
      await compile_constraint(...) ──▶         engine.grammars.compile(constraint)
      ◀── the compiled constraint, or InvalidConstraint (INVALID_ARGUMENT, a 400)

A constraint compiled before is taken from the compiler's cache on the
event loop (a dict lookup), without waiting for a worker: services send the
same schema with every request. Its text's size was checked before
(``Limits.max_constraint_bytes``).
"""

from __future__ import annotations

import asyncio
import functools
from typing import TYPE_CHECKING

from slipstream.service.api.wire import utf8_len

if TYPE_CHECKING:
    from slipstream.scheduler.request import OutputConstraint
    from slipstream.service.api.workers import WorkerPool
    from slipstream.service.engine.engine import Engine


async def compile_constraint(
    engine: Engine, constraint: OutputConstraint, workers: WorkerPool | None
) -> OutputConstraint:
    """``constraint`` compiled, to put in its ``RequestSpec`` in its place
    (the engine then starts each request's matcher from it): on the server's
    worker pool (full: ``WorkersBusy``, QUEUE_FULL) or, without one, a plain
    thread. Raises ``InvalidConstraint`` (a ``ValueError``)."""
    grammar = engine.grammars.cached(constraint)
    if grammar is not None:
        return grammar
    compile_it = functools.partial(engine.grammars.compile, constraint)
    if workers is None:
        return await asyncio.to_thread(compile_it)
    return await workers.run(compile_it, utf8_len(constraint.text))
