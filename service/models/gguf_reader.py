"""Reading a llama-architecture GGUF file: its hyperparameters, its
tokenizer, and a plan of every tensor (Hugging Face name, shape, Q/K row
permutation), checked whole before anything is written; ``dequantize``
turns a planned tensor into float32 in Hugging Face layout.

Every problem raises ``GGUFImportError`` naming it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import gguf

# llama.cpp token types (gguf.TokenType), kept as ints to read the raw array.
CONTROL, USER_DEFINED = 3, 4

# The tokenizer.ggml.pre values whose pre-tokenization this module reproduces,
# following llama.cpp's own table (llama-vocab.cpp). Any other value is refused:
# a wrong split would tokenize text differently from the model's training.
GPT2_PRE = ("gpt2", "mpt", "olmo")
DIGIT_SPLIT_PRE = ("smollm", "starcoder", "refact", "codeshell")
LLAMA3_PRE = ("llama3", "llama-v3", "llama-bpe")
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# GGUF tensor name in a block -> Hugging Face name, and whether llama.cpp
# permuted its rows (by how many heads).
_BLOCK_TENSORS = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


class GGUFImportError(ValueError):
    """The GGUF file cannot be converted; the message names the problem."""


@dataclass(frozen=True, slots=True)
class LlamaShape:
    """Hyperparameters from the file's ``llama.*`` metadata."""

    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    context_length: int
    rms_norm_eps: float
    rope_theta: float


@dataclass(frozen=True, slots=True)
class TokenizerSpec:
    """The vocabulary and special tokens from the file's ``tokenizer.*`` metadata."""

    pre: str
    tokens: list[str]
    token_types: list[int]
    merges: list[tuple[str, str]]
    bos_id: int | None
    eos_id: int
    pad_id: int | None
    unk_id: int | None
    end_of_turn_ids: tuple[int, ...]
    add_bos: bool
    add_eos: bool
    chat_template: str | None


@dataclass(frozen=True, slots=True)
class PlannedTensor:
    hf_name: str
    source: gguf.ReaderTensor
    shape: tuple[int, ...]
    # Heads to un-permute rows over (Q: attention heads, K: KV heads), else 0.
    unpermute_heads: int


# ------------------------------------------------------------------ reading


def open_gguf(path: Path) -> gguf.GGUFReader:
    """A reader over ``path``; an unreadable file raises ``GGUFImportError``."""
    import gguf

    try:
        reader = gguf.GGUFReader(path)
    except ValueError as exc:
        # The reader builds tensor types with GGMLQuantizationType(raw): an id
        # the enum lacks fails there, before any tensor can be inspected.
        if "GGMLQuantizationType" in str(exc):
            raise GGUFImportError(
                f"{path}: a tensor has a type unknown to the gguf package {gguf_version()} ({exc})"
            ) from exc
        raise GGUFImportError(
            f"{path}: not a readable GGUF file, truncated or corrupt ({exc})"
        ) from exc
    except (IndexError, KeyError, OverflowError, UnicodeDecodeError, TypeError) as exc:
        # Reads past the end of a memory map come back short and fail here.
        raise GGUFImportError(f"{path}: truncated or corrupt GGUF file ({exc!r})") from exc
    if reader.byte_order != "I":
        raise GGUFImportError(f"{path}: big-endian GGUF files are not supported")
    file_size = int(reader.data.size)
    for tensor in reader.tensors:
        if tensor.data_offset + tensor.n_bytes > file_size:
            raise GGUFImportError(f"{path}: truncated: tensor {tensor.name!r} ends past the file")
    return reader


def read_llama_shape(reader: gguf.GGUFReader) -> LlamaShape:
    """The model's hyperparameters; raises ``GGUFImportError`` unless the
    file is a dense llama with plain RoPE and every needed key."""
    arch = _required(reader, "general.architecture")
    if arch != "llama":
        raise GGUFImportError(
            f"architecture {arch!r} is not supported: only 'llama' GGUF files can be imported"
        )
    keys = {
        name: f"llama.{name}"
        for name in (
            "block_count",
            "embedding_length",
            "feed_forward_length",
            "attention.head_count",
            "context_length",
            "attention.layer_norm_rms_epsilon",
        )
    }
    missing = [key for key in keys.values() if key not in reader.fields]
    if missing:
        raise GGUFImportError(f"missing metadata: {', '.join(missing)}")
    if _optional(reader, "llama.expert_count", 0):
        raise GGUFImportError("mixture-of-experts llama files are not supported")
    scaling = _optional(reader, "llama.rope.scaling.type", "none")
    if scaling != "none" or _optional(reader, "llama.rope.scale_linear", 1.0) != 1.0:
        raise GGUFImportError(f"RoPE scaling {scaling!r} is not supported")
    if any(t.name == "rope_freqs.weight" for t in reader.tensors):
        raise GGUFImportError("per-dimension RoPE frequencies (rope_freqs) are not supported")

    hidden = _as_int(reader, keys["embedding_length"])
    heads = _as_int(reader, keys["attention.head_count"])
    head_dim = int(_optional(reader, "llama.attention.key_length", hidden // heads))
    if _optional(reader, "llama.attention.value_length", head_dim) != head_dim:
        raise GGUFImportError("key and value head sizes differ; not a llama layout")
    rope_dims = _optional(reader, "llama.rope.dimension_count", head_dim)
    if rope_dims != head_dim or head_dim % 2:
        raise GGUFImportError(
            f"RoPE over {rope_dims} of {head_dim} head dimensions is not supported"
        )
    embedding = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    if embedding is None:
        raise GGUFImportError("missing tensors: token_embd.weight")
    return LlamaShape(
        num_layers=_as_int(reader, keys["block_count"]),
        hidden_size=hidden,
        intermediate_size=_as_int(reader, keys["feed_forward_length"]),
        num_heads=heads,
        num_kv_heads=int(_optional(reader, "llama.attention.head_count_kv", heads)),
        head_dim=head_dim,
        # Older files omit vocab_size; the embedding's row count is the same number.
        vocab_size=int(_optional(reader, "llama.vocab_size", int(embedding.shape[-1]))),
        context_length=_as_int(reader, keys["context_length"]),
        rms_norm_eps=_float32_value(reader, keys["attention.layer_norm_rms_epsilon"]),
        rope_theta=_float32_value(reader, "llama.rope.freq_base", 10000.0),
    )


def read_tokenizer_spec(reader: gguf.GGUFReader) -> TokenizerSpec:
    """The byte-level BPE the file describes; other tokenizer kinds raise ``GGUFImportError``."""
    model = _required(reader, "tokenizer.ggml.model")
    if model != "gpt2":
        raise GGUFImportError(
            f"tokenizer model {model!r} is not supported: only byte-level BPE ('gpt2')"
        )
    pre = _optional(reader, "tokenizer.ggml.pre", "default")
    if pre not in GPT2_PRE + DIGIT_SPLIT_PRE + LLAMA3_PRE:
        raise GGUFImportError(f"pre-tokenizer {pre!r} is not supported")
    tokens = list(_required(reader, "tokenizer.ggml.tokens"))
    token_types = list(_optional(reader, "tokenizer.ggml.token_type", [1] * len(tokens)))
    merges = [_split_merge(m) for m in _required(reader, "tokenizer.ggml.merges")]
    eos = int(_required(reader, "tokenizer.ggml.eos_token_id"))
    ids = {
        key: _optional(reader, f"tokenizer.ggml.{key}", None)
        for key in ("bos_token_id", "padding_token_id", "unknown_token_id")
    }
    end_of_turn = tuple(
        dict.fromkeys(
            int(i)
            for i in (
                eos,
                _optional(reader, "tokenizer.ggml.eot_token_id", None),
                _optional(reader, "tokenizer.ggml.eom_token_id", None),
            )
            if i is not None
        )
    )
    for name, token_id in (("eos", eos), *ids.items()):
        if token_id is not None and not 0 <= int(token_id) < len(tokens):
            raise GGUFImportError(f"{name} id {token_id} is outside the vocabulary")
    template = _optional(reader, "tokenizer.chat_template", None)
    return TokenizerSpec(
        pre=pre,
        tokens=tokens,
        token_types=[int(t) for t in token_types],
        merges=merges,
        bos_id=_int_or_none(ids["bos_token_id"]),
        eos_id=eos,
        pad_id=_int_or_none(ids["padding_token_id"]),
        unk_id=_int_or_none(ids["unknown_token_id"]),
        end_of_turn_ids=end_of_turn,
        # llama.cpp's default when the key is absent: BOS for Llama 3 vocabularies only.
        add_bos=bool(_optional(reader, "tokenizer.ggml.add_bos_token", pre in LLAMA3_PRE)),
        add_eos=bool(_optional(reader, "tokenizer.ggml.add_eos_token", False)),
        chat_template=template if isinstance(template, str) else None,
    )


def plan_tensors(reader: gguf.GGUFReader, shape: LlamaShape) -> list[PlannedTensor]:
    """Every tensor of the file under its Hugging Face name, in checkpoint order.

    Checks, before anything is dequantized, that the set of tensors is exactly
    a llama's (``output.weight`` optional: absent means tied embeddings), that
    each has the shape the metadata implies and a type the gguf package can
    dequantize.
    """
    expected = _expected_shapes(shape)
    by_name = {t.name: t for t in reader.tensors}
    unknown = sorted(set(by_name) - set(expected))
    if unknown:
        raise GGUFImportError(f"unexpected tensors for a llama: {', '.join(unknown[:5])}")
    missing = [name for name in expected if name not in by_name and name != "output.weight"]
    if missing:
        raise GGUFImportError(f"missing tensors: {', '.join(missing[:5])}")
    plan = []
    for gguf_name, (hf_name, hf_shape, heads) in expected.items():
        tensor = by_name.get(gguf_name)
        if tensor is None:
            continue
        # GGUF lists dimensions fastest-first; PyTorch's order is the reverse.
        file_shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
        if file_shape != hf_shape:
            raise GGUFImportError(
                f"tensor {gguf_name!r} has shape {file_shape}; the metadata implies {hf_shape}"
            )
        _check_dequantizable(tensor)
        plan.append(PlannedTensor(hf_name, tensor, hf_shape, heads))
    return plan


def _expected_shapes(shape: LlamaShape) -> dict[str, tuple[str, tuple[int, ...], int]]:
    h, d = shape.hidden_size, shape.head_dim
    q_rows, kv_rows = shape.num_heads * d, shape.num_kv_heads * d
    expected: dict[str, tuple[str, tuple[int, ...], int]] = {
        "token_embd.weight": ("model.embed_tokens.weight", (shape.vocab_size, h), 0)
    }
    for i in range(shape.num_layers):
        block_shapes = {
            "attn_norm": ((h,), 0),
            "attn_q": ((q_rows, h), shape.num_heads),
            "attn_k": ((kv_rows, h), shape.num_kv_heads),
            "attn_v": ((kv_rows, h), 0),
            "attn_output": ((h, q_rows), 0),
            "ffn_norm": ((h,), 0),
            "ffn_gate": ((shape.intermediate_size, h), 0),
            "ffn_up": ((shape.intermediate_size, h), 0),
            "ffn_down": ((h, shape.intermediate_size), 0),
        }
        for short, (tensor_shape, heads) in block_shapes.items():
            hf = f"model.layers.{i}.{_BLOCK_TENSORS[short]}.weight"
            expected[f"blk.{i}.{short}.weight"] = (hf, tensor_shape, heads)
    expected["output_norm.weight"] = ("model.norm.weight", (h,), 0)
    expected["output.weight"] = ("lm_head.weight", (shape.vocab_size, h), 0)
    return expected


def _check_dequantizable(tensor: gguf.ReaderTensor) -> None:
    import gguf

    _, type_size = gguf.GGML_QUANT_SIZES[tensor.tensor_type]
    probe = np.zeros((1, type_size), dtype=np.uint8)
    try:
        gguf.quants.dequantize(probe, tensor.tensor_type)
    except NotImplementedError:
        raise GGUFImportError(
            f"tensor {tensor.name!r} has type {tensor.tensor_type.name}, which the gguf "
            f"package {gguf_version()} cannot dequantize"
        ) from None


def gguf_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("gguf")
    except PackageNotFoundError:
        return "(version unknown)"


# ------------------------------------------------------------------ weights


def unpermute_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (its ``permute`` in convert_hf_to_gguf).

    Hugging Face rotates the two halves of each head (``rotate_half``);
    llama.cpp rotates adjacent pairs, so its converter interleaves the halves:
    a head's rows ``[a0..a(n-1), b0..b(n-1)]`` are stored as
    ``[a0, b0, a1, b1, ...]``. Reading them back as ``[head, n, 2]`` and
    swapping the last two axes restores ``[head, 2, n]``.
    """
    rows = weight.shape[0]
    half = rows // num_heads // 2
    return (
        weight.reshape(num_heads, half, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)
    )


def dequantize(planned: PlannedTensor) -> np.ndarray:
    """The tensor as float32 in Hugging Face layout (Q/K rows un-permuted)."""
    import gguf

    source = planned.source
    try:
        values = gguf.quants.dequantize(source.data, source.tensor_type)
    except NotImplementedError as exc:
        raise GGUFImportError(f"tensor {source.name!r}: {exc}") from exc
    values = np.asarray(values, dtype=np.float32).reshape(planned.shape)
    if planned.unpermute_heads:
        values = unpermute_rows(values, planned.unpermute_heads)
    # F32 tensors come back as read-only views of the memory map; torch wants its own copy.
    return np.ascontiguousarray(values) if values.flags.writeable else values.copy()


# ------------------------------------------------------------------ helpers


_ABSENT = object()


def _required(reader: gguf.GGUFReader, key: str) -> Any:
    value = _optional(reader, key, _ABSENT)
    if value is _ABSENT:
        raise GGUFImportError(f"missing metadata: {key}")
    return value


def _optional(reader: gguf.GGUFReader, key: str, default: Any) -> Any:
    field = reader.fields.get(key)
    if field is None:
        return default
    try:
        return field.contents()
    except (UnicodeDecodeError, IndexError, ValueError) as exc:
        raise GGUFImportError(f"metadata {key} is corrupt ({exc!r})") from exc


def _as_int(reader: gguf.GGUFReader, key: str) -> int:
    value = _required(reader, key)
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise GGUFImportError(f"metadata {key} should be an integer, not {value!r}")
    return int(value)


def _float32_value(reader: gguf.GGUFReader, key: str, default: float | None = None) -> float:
    value = _required(reader, key) if default is None else _optional(reader, key, default)
    # GGUF stores float32; its shortest decimal (1e-05, not 9.9999997e-06) is
    # the value the original config held and the same float32 once read.
    return float(str(np.float32(value)))


def _int_or_none(value: Any) -> int | None:
    return None if value is None else int(value)


def _split_merge(merge: str) -> tuple[str, str]:
    left, sep, right = merge.partition(" ")
    if not sep or not left or not right:
        raise GGUFImportError(f"malformed BPE merge {merge!r}")
    return left, right
