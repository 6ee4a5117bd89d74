"""The Python clients against a real server on ``tiny``: what a caller's
chunk loop sees matches the request's result; a constraint shapes the
output, and one the server cannot compile is refused; a logit bias and a
penalty change what greedy decoding picks."""

from __future__ import annotations

import asyncio
import json
import re
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


def test_a_constrained_request_answers_in_its_shape_from_either_client(
    server: ServerThread,
) -> None:
    """``tiny``'s random weights never write digits or a yes/no JSON string
    unasked: each output below is the constraint's doing."""
    with Client(server.target) as client:
        digits = client.generate("Hello", max_tokens=8, regex="[0-9]{3}").result(timeout=30)
        answer = client.generate_one(
            "Hi", max_tokens=8, json_schema={"enum": ["yes", "no"]}
        ).result(timeout=30)
    assert re.fullmatch("[0-9]{3}", digits.text), digits
    assert digits.finish_reason == "stop_sequence"  # complete: it ends there
    assert json.loads(answer.text) in ("yes", "no"), answer

    async def scenario() -> Result:
        async with AsyncClient(server.target) as client:
            generation = await client.generate("Hello", max_tokens=8, regex="(yes|no)")
            return await generation.result()

    result = asyncio.run(scenario())
    assert result.text in ("yes", "no"), result


def test_a_schema_the_server_cannot_compile_is_refused_with_its_reason(
    server: ServerThread,
) -> None:
    with Client(server.target) as client:
        result = client.generate("Hello", json_schema={"type": "no such type"}).result(timeout=30)
    assert (result.finish_reason, result.status_code) == ("rejected", "INVALID_ARGUMENT")
    assert "json_schema" in result.message, result


def test_a_bias_changes_the_greedy_first_token_from_either_client(server: ServerThread) -> None:
    """-100 in effect bans the greedy token; 100 makes another the only choice."""
    with Client(server.target) as client:
        [first] = client.generate("Hello", max_tokens=1, ignore_eos=True).result(30).token_ids
        other = 7 if first != 7 else 8
        banned = client.generate("Hello", max_tokens=1, ignore_eos=True, logit_bias={first: -100})
        chosen = client.generate_one(
            "Hello", max_tokens=1, ignore_eos=True, logit_bias={other: 100.0}
        )
        [second], [forced] = banned.result(30).token_ids, chosen.result(30).token_ids
    assert second != first
    assert forced == other

    async def scenario() -> list[int]:
        async with AsyncClient(server.target) as client:
            generation = await client.generate_one(
                "Hello", max_tokens=1, ignore_eos=True, logit_bias={first: -100}
            )
            return (await generation.result()).token_ids

    assert asyncio.run(scenario()) == [second]


def test_a_frequency_penalty_stops_the_greedy_answer_repeating_a_token(
    server: ServerThread,
) -> None:
    """tiny's greedy answer to "Hello there" repeats a token within 24
    (tests/service/api/test_sampling_adjustments.py); penalised, it does not."""
    with Client(server.target) as client:
        plain = client.generate("Hello there", max_tokens=24, ignore_eos=True).result(30)
        penalised = client.generate_one(
            "Hello there", max_tokens=24, ignore_eos=True, frequency_penalty=2.0
        ).result(30)
    assert len(set(plain.token_ids)) < len(plain.token_ids)
    assert len(set(penalised.token_ids)) == len(penalised.token_ids) == 24
