"""The Python clients against a real server on ``tiny``: what a caller's
chunk loop sees matches the request's result."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
from server_thread import ServerThread

from slipstream.clients import AsyncClient, Client, Result
from slipstream.service.engine.config import EngineConfig

CONFIG = EngineConfig(model="tiny", dtype="float32", calibrate_cost_model=False)
# Never matched by tiny's output, but held back: the last len - 1 characters
# could still become it until the request ends, and come only with Finished.
NEVER_MATCHED = "\x00never said\x00"


@pytest.fixture(scope="module")
def server(engine: object) -> Iterator[ServerThread]:
    srv = ServerThread(engine)
    yield srv
    srv.stop()


def _assert_chunks_spell_the_result(texts: list[str], result: Result) -> None:
    assert result.finish_reason == "max_tokens"
    assert len(result.text) >= len(NEVER_MATCHED), "too short to hold anything back"
    assert "".join(texts) == result.text


def test_a_chunk_loop_sees_the_text_held_back_for_stop_sequences(server: ServerThread) -> None:
    """The held-back tail came only in Result.text: ``for chunk in gen:
    print(chunk.text)`` (the README's example) lost it."""
    options = {"max_tokens": 24, "ignore_eos": True, "stop": [NEVER_MATCHED]}
    with Client(server.target) as client:
        generations = [client.generate("Hello", **options), client.generate_one("Hi", **options)]
        for generation in generations:
            texts = [chunk.text for chunk in generation]
            _assert_chunks_spell_the_result(texts, generation.result(timeout=30))

    async def scenario() -> None:
        async with AsyncClient(server.target) as client:
            generation = await client.generate("Hello", **options)
            texts = [chunk.text async for chunk in generation]
            _assert_chunks_spell_the_result(texts, await generation.result())

    asyncio.run(scenario())
