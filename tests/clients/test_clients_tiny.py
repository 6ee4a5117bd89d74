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
OPTIONS = {"max_tokens": 24, "ignore_eos": True}
HELD_BACK = 4  # characters at the end of the output that could begin the stop string


@pytest.fixture(scope="module")
def server(engine: object) -> Iterator[ServerThread]:
    srv = ServerThread(engine)
    yield srv
    srv.stop()


def _stop_held_back(client: Client, prompt: str) -> list[str]:
    """A stop string (greedy) output never matches, but whose start its last
    characters are: they are held back until the request ends, and come only
    with Finished."""
    text = client.generate(prompt, **OPTIONS).result(timeout=30).text
    assert len(text) > HELD_BACK, "too short to hold anything back"
    return [text[-HELD_BACK:] + "\x00never said\x00"]


def _assert_chunks_spell_the_result(texts: list[str], result: Result) -> None:
    assert result.finish_reason == "max_tokens"
    assert "".join(texts) == result.text


def test_a_chunk_loop_sees_the_text_held_back_for_stop_sequences(server: ServerThread) -> None:
    """The held-back tail came only in Result.text: ``for chunk in gen:
    print(chunk.text)`` (the README's example) lost it."""
    with Client(server.target) as client:
        stops = {prompt: _stop_held_back(client, prompt) for prompt in ("Hello", "Hi")}
        generations = [
            client.generate("Hello", **OPTIONS, stop=stops["Hello"]),
            client.generate_one("Hi", **OPTIONS, stop=stops["Hi"]),
        ]
        for generation in generations:
            texts = [chunk.text for chunk in generation]
            _assert_chunks_spell_the_result(texts, generation.result(timeout=30))

    async def scenario() -> None:
        async with AsyncClient(server.target) as client:
            generation = await client.generate("Hello", **OPTIONS, stop=stops["Hello"])
            texts = [chunk.text async for chunk in generation]
            _assert_chunks_spell_the_result(texts, await generation.result())

    asyncio.run(scenario())
