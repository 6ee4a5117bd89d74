"""Convert a llama-architecture GGUF file into a Hugging Face checkpoint folder.

``import_gguf(gguf_path, out_dir)`` reads the file with the ``gguf`` package,
dequantizes every tensor, undoes llama.cpp's row permutation of the Q and K
projections, and writes what ``LlamaForCausalLM`` and ``AutoTokenizer`` load:

    config.json              generation_config.json
    model.safetensors        (or model-0000k-of-0000n.safetensors + index)
    tokenizer.json           tokenizer_config.json     special_tokens_map.json

Invariants:

- ``out_dir`` either does not exist or is complete: the folder is built in a
  temporary directory beside it and renamed into place; any failure removes
  the temporary directory and leaves no ``out_dir``.
- Every tensor of the file is accounted for. A tensor this converter does not
  know, a missing one, an unknown or undequantizable type, a shape that
  disagrees with the metadata, or missing metadata raises ``GGUFImportError``
  before anything is written.
- Weights are the file's values, dequantized to float32 and then cast to the
  requested dtype: nothing is re-quantized, re-scaled or re-initialised.

This module depends on numpy, torch, safetensors, tokenizers and gguf only.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from slipstream.service.models.gguf_reader import (
    CONTROL,
    DIGIT_SPLIT_PRE,
    LLAMA3_PRE,
    LLAMA3_SPLIT,
    USER_DEFINED,
    LlamaShape,
    PlannedTensor,
    TokenizerSpec,
    dequantize,
    open_gguf,
    plan_tensors,
    read_llama_shape,
    read_tokenizer_spec,
)
from slipstream.service.models.gguf_reader import (
    GGUFImportError as GGUFImportError,  # what import_gguf raises
)

if TYPE_CHECKING:
    import torch
    from tokenizers import Tokenizer

# Bump when the files written for the same GGUF change, so caches keyed on it rebuild.
CONVERTER_VERSION = 1
DTYPES = ("float32", "bfloat16")
DEFAULT_MAX_SHARD_BYTES = 2 << 30


def import_gguf(
    gguf_path: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    dtype: str = "float32",
    *,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
) -> Path:
    """Write the Hugging Face checkpoint of ``gguf_path`` to ``out_dir``; return ``out_dir``.

    ``dtype`` is the dtype the weights are saved in (``float32`` keeps every
    dequantized value exactly). Weights go into one ``model.safetensors``
    unless they exceed ``max_shard_bytes``; then into shards with an index,
    so memory use stays near one shard rather than the whole model.

    Raises ``GGUFImportError`` for a file that cannot be converted,
    ``FileExistsError`` when ``out_dir`` exists (it is never overwritten) and
    ``FileNotFoundError`` when ``gguf_path`` does not.
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, not {dtype!r}")
    source, out = Path(gguf_path), Path(out_dir)
    if not source.is_file():
        raise FileNotFoundError(f"no GGUF file at {source}")
    if out.exists():
        raise FileExistsError(f"{out} already exists; not overwriting it")
    reader = open_gguf(source)
    shape = read_llama_shape(reader)
    tokenizer_spec = read_tokenizer_spec(reader)
    tensors = plan_tensors(reader, shape)
    tied = not any(t.hf_name == "lm_head.weight" for t in tensors)

    out.parent.mkdir(parents=True, exist_ok=True)
    build_dir = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        _write_weights(tensors, build_dir, dtype, max_shard_bytes)
        build_tokenizer(tokenizer_spec).save(str(build_dir / "tokenizer.json"))
        _write_json(build_dir / "config.json", hf_config(shape, tokenizer_spec, tied, dtype))
        _write_json(build_dir / "generation_config.json", _generation_config(tokenizer_spec))
        _write_json(build_dir / "tokenizer_config.json", _tokenizer_config(tokenizer_spec, shape))
        _write_json(build_dir / "special_tokens_map.json", _special_tokens_map(tokenizer_spec))
        _make_world_readable(build_dir)
        try:
            os.rename(build_dir, out)
        except OSError as exc:
            # Another writer's folder appeared meanwhile (rename of a directory
            # onto a non-empty one fails): it wins, this build is dropped.
            if out.exists():
                raise FileExistsError(f"{out} already exists; not overwriting it") from exc
            raise
    except BaseException:
        shutil.rmtree(build_dir, ignore_errors=True)
        raise
    return out


def _write_weights(
    tensors: list[PlannedTensor], out_dir: Path, dtype: str, max_shard_bytes: int
) -> None:
    import torch
    from safetensors.torch import save_file

    torch_dtype = getattr(torch, dtype)
    itemsize = torch.empty((), dtype=torch_dtype).element_size()
    shards = list(_shards(tensors, itemsize, max_shard_bytes))
    weight_map: dict[str, str] = {}
    total = 0
    for index, shard in enumerate(shards, start=1):
        filename = (
            "model.safetensors"
            if len(shards) == 1
            else f"model-{index:05d}-of-{len(shards):05d}.safetensors"
        )
        state: dict[str, torch.Tensor] = {}
        for planned in shard:
            state[planned.hf_name] = torch.from_numpy(dequantize(planned)).to(torch_dtype)
            weight_map[planned.hf_name] = filename
            total += state[planned.hf_name].numel() * itemsize
        save_file(state, str(out_dir / filename), metadata={"format": "pt"})
        del state
    if len(shards) > 1:
        _write_json(
            out_dir / "model.safetensors.index.json",
            {"metadata": {"total_size": total}, "weight_map": weight_map},
        )


def _shards(
    tensors: list[PlannedTensor], itemsize: int, max_bytes: int
) -> Iterator[list[PlannedTensor]]:
    shard: list[PlannedTensor] = []
    size = 0
    for planned in tensors:
        nbytes = math.prod(planned.shape) * itemsize
        if shard and size + nbytes > max_bytes:
            yield shard
            shard, size = [], 0
        shard.append(planned)
        size += nbytes
    if shard:
        yield shard


# ---------------------------------------------------------------- tokenizer


def build_tokenizer(spec: TokenizerSpec) -> Tokenizer:
    """A ``tokenizers`` byte-level BPE equal to llama.cpp's reading of the file.

    Ids are the file's token indices. Control tokens (and the BOS/EOS/PAD/UNK
    ids) become special added tokens and user-defined ones plain added tokens,
    so both are matched whole in text as llama.cpp does. BOS/EOS are added to
    encoded text exactly when the file says so.
    """
    from tokenizers import (
        AddedToken,
        Regex,
        Tokenizer,
        decoders,
        models,
        pre_tokenizers,
        processors,
    )

    vocab: dict[str, int] = {}
    for index, token in enumerate(spec.tokens):
        vocab.setdefault(token, index)  # a repeated spelling keeps its first id
    # llama.cpp looks a whole Llama 3 pre-token up in the vocabulary before merging.
    ignore_merges = spec.pre in LLAMA3_PRE
    tokenizer = Tokenizer(models.BPE(vocab, spec.merges, ignore_merges=ignore_merges))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if spec.pre in DIGIT_SPLIT_PRE:
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level]
        )
    elif spec.pre in LLAMA3_PRE:
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    else:
        tokenizer.pre_tokenizer = byte_level
    tokenizer.decoder = decoders.ByteLevel()

    named = {i for i in (spec.bos_id, spec.eos_id, spec.pad_id, spec.unk_id) if i is not None}
    special = [
        AddedToken(token, special=True, normalized=False)
        for i, (token, kind) in enumerate(zip(spec.tokens, spec.token_types, strict=True))
        if kind == CONTROL or i in named
    ]
    user_defined = [
        AddedToken(token, special=False, normalized=False)
        for token, kind in zip(spec.tokens, spec.token_types, strict=True)
        if kind == USER_DEFINED
    ]
    tokenizer.add_special_tokens(special)
    tokenizer.add_tokens(user_defined)

    if (spec.add_bos and spec.bos_id is not None) or spec.add_eos:
        bos = spec.tokens[spec.bos_id] if spec.add_bos and spec.bos_id is not None else None
        eos = spec.tokens[spec.eos_id] if spec.add_eos else None
        ends = [(t, vocab[t]) for t in (bos, eos) if t is not None]
        single = " ".join(x for x in (bos, "$A", eos) if x)
        pair = " ".join(x for x in (single, bos and f"{bos}:1", "$B:1", eos and f"{eos}:1") if x)
        tokenizer.post_processor = processors.TemplateProcessing(
            single=single, pair=pair, special_tokens=list(dict.fromkeys(ends))
        )
    return tokenizer


# ----------------------------------------------------------------- metadata


def hf_config(shape: LlamaShape, tok: TokenizerSpec, tied: bool, dtype: str) -> dict[str, Any]:
    """``config.json`` for ``LlamaForCausalLM``; RoPE given both ways for older readers."""
    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": shape.vocab_size,
        "hidden_size": shape.hidden_size,
        "intermediate_size": shape.intermediate_size,
        "num_hidden_layers": shape.num_layers,
        "num_attention_heads": shape.num_heads,
        "num_key_value_heads": shape.num_kv_heads,
        "head_dim": shape.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": shape.context_length,
        "rms_norm_eps": shape.rms_norm_eps,
        "rope_theta": shape.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": shape.rope_theta},
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "tie_word_embeddings": tied,
        "initializer_range": 0.02,
        "use_cache": True,
        "torch_dtype": dtype,
        "dtype": dtype,
    }
    return config | _special_ids(tok)


def _special_ids(tok: TokenizerSpec) -> dict[str, Any]:
    # Every end-of-generation id (EOS, end of turn, end of message), as
    # llama.cpp stops on all of them; a single id stays a plain int.
    eos: int | list[int] = (
        tok.end_of_turn_ids[0] if len(tok.end_of_turn_ids) == 1 else list(tok.end_of_turn_ids)
    )
    ids: dict[str, Any] = {"bos_token_id": tok.bos_id, "eos_token_id": eos}
    if tok.pad_id is not None:
        ids["pad_token_id"] = tok.pad_id
    return ids


def _generation_config(tok: TokenizerSpec) -> dict[str, Any]:
    return _special_ids(tok)


def _special_tokens_map(tok: TokenizerSpec) -> dict[str, str]:
    named = {
        "bos_token": tok.bos_id,
        "eos_token": tok.eos_id,
        "pad_token": tok.pad_id,
        "unk_token": tok.unk_id,
    }
    return {key: tok.tokens[i] for key, i in named.items() if i is not None}


def _tokenizer_config(tok: TokenizerSpec, shape: LlamaShape) -> dict[str, Any]:
    # The generic fast class keeps tokenizer.json as written. add_bos_token /
    # add_eos_token restate the post-processor's choice, so transformers,
    # which rebuilds the post-processor from them, agrees with it.
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **_special_tokens_map(tok),
        "add_bos_token": tok.add_bos and tok.bos_id is not None,
        "add_eos_token": tok.add_eos,
        "clean_up_tokenization_spaces": False,
        "model_max_length": shape.context_length,
    }
    if tok.chat_template is not None:
        config["chat_template"] = tok.chat_template
    return config


# ------------------------------------------------------------------ helpers


def _make_world_readable(directory: Path) -> None:
    # mkdtemp (and safetensors) create private modes; a model cache may be shared.
    directory.chmod(0o755)
    for path in directory.iterdir():
        path.chmod(0o644)


def _write_json(path: Path, data: Mapping[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True, ensure_ascii=False) + "\n")
