"""The default models (``tiny``, ``small``): what each one is (``ModelSpec``)
and how its files are made, deterministically from its seed: random Llama
weights initialised to be a useful test subject, and a byte-level BPE
tokenizer trained on the corpus committed in ``assets/``. The same code,
corpus and library versions give byte-identical files on any machine;
``fingerprint`` names everything the files depend on.
"""

from __future__ import annotations

import functools
import hashlib
import json
import lzma
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch
    from tokenizers import Tokenizer

CORPUS_PATH = Path(__file__).with_name("assets") / "corpus.txt.xz"
# Bump when the file format written here changes in a way the spec does not capture.
FORMAT_VERSION = 1

UNK, BOS, EOS, PAD = "<unk>", "<s>", "</s>", "<pad>"
# Order fixes the ids: unk 0, bos 1, eos 2 as in Llama; pad 3.
SPECIAL_TOKENS = (UNK, BOS, EOS, PAD)


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """Shape and seed of a default model. ``dtype`` is the dtype its weights are saved in.

    The initialisation is chosen so a random model is a useful test subject
    rather than the usual ``normal(0, 0.02)`` everywhere, under which each
    layer adds ~1% to the residual stream and the next token depends on the
    last token alone (a broken KV cache would go unnoticed):

    - projections use ``linear_gain / sqrt(fan_in)``, so attention scores and
      layer outputs are of order one and the prediction depends on context;
    - ``lm_head`` uses ``logit_scale / sqrt(hidden_size)``, so logits have a
      standard deviation near ``logit_scale``: greedy decoding wanders over
      the vocabulary instead of repeating one token, and near-ties between
      the top two logits (where summation order could flip argmax) are rare.
    """

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    max_position_embeddings: int
    dtype: str
    seed: int = 0
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    embedding_std: float = 1.0
    linear_gain: float = 1.0
    logit_scale: float = 3.0
    # The LM head is the embedding (no lm_head.weight), as in SmolLM2.
    tie_word_embeddings: bool = False

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


DEFAULT_MODELS: dict[str, ModelSpec] = {
    "tiny": ModelSpec(
        vocab_size=4096,
        hidden_size=128,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=384,
        max_position_embeddings=1024,
        dtype="float32",
    ),
    "small": ModelSpec(
        vocab_size=8192,
        hidden_size=512,
        num_layers=8,
        num_heads=8,
        num_kv_heads=4,
        intermediate_size=2304,
        max_position_embeddings=2048,
        dtype="bfloat16",
    ),
    # SmolLM2-135M's exact shape with seeded random weights and a tokenizer
    # trained here (its vocabulary is what the corpus yields; the model's is
    # 49,152): for speed figures where the real checkpoint cannot be had, such
    # as a GPU machine without the registry. Not for anything about text.
    "smollm2-shape": ModelSpec(
        vocab_size=49152,
        hidden_size=576,
        num_layers=30,
        num_heads=9,
        num_kv_heads=3,
        intermediate_size=1536,
        max_position_embeddings=8192,
        dtype="bfloat16",
        rope_theta=100000.0,
        tie_word_embeddings=True,
    ),
}


def write_model_files(spec: ModelSpec, out_dir: Path) -> None:
    """Write a complete Hugging Face checkpoint for ``spec`` into ``out_dir``."""
    train_tokenizer(spec.vocab_size).save(str(out_dir / "tokenizer.json"))
    save_weights(spec, out_dir / "model.safetensors")
    _write_json(out_dir / "config.json", hf_config(spec))
    _write_json(out_dir / "generation_config.json", _special_token_ids())
    _write_json(out_dir / "tokenizer_config.json", _tokenizer_config(spec))
    _write_json(out_dir / "special_tokens_map.json", _special_tokens_map())


def train_tokenizer(vocab_size: int) -> Tokenizer:
    """A byte-level BPE over the committed corpus, adding BOS like Llama's tokenizer.

    No normalizer, and every byte is in the initial alphabet, so decoding
    round-trips any UTF-8 text.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(load_corpus().split("\n\n"), trainer)
    bos_id = SPECIAL_TOKENS.index(BOS)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS}:1 $B:1", special_tokens=[(BOS, bos_id)]
    )
    return tokenizer


def save_weights(spec: ModelSpec, path: Path) -> None:
    """Seeded random weights under Hugging Face Llama names, saved in ``spec.dtype``."""
    import torch
    from safetensors.torch import save_file

    dtype = getattr(torch, spec.dtype)
    tensors = {
        name: _random_tensor(spec, name, shape).to(dtype)
        for name, shape in _weight_shapes(spec).items()
    }
    save_file(tensors, str(path), metadata={"format": "pt"})


def _weight_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    hidden, kv_dim = spec.hidden_size, spec.num_kv_heads * spec.head_dim
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (spec.vocab_size, hidden),
        "model.norm.weight": (hidden,),
    }
    if not spec.tie_word_embeddings:
        shapes["lm_head.weight"] = (spec.vocab_size, hidden)
    for i in range(spec.num_layers):
        prefix = f"model.layers.{i}"
        shapes |= {
            f"{prefix}.input_layernorm.weight": (hidden,),
            f"{prefix}.post_attention_layernorm.weight": (hidden,),
            f"{prefix}.self_attn.q_proj.weight": (spec.num_heads * spec.head_dim, hidden),
            f"{prefix}.self_attn.k_proj.weight": (kv_dim, hidden),
            f"{prefix}.self_attn.v_proj.weight": (kv_dim, hidden),
            f"{prefix}.self_attn.o_proj.weight": (hidden, spec.num_heads * spec.head_dim),
            f"{prefix}.mlp.gate_proj.weight": (spec.intermediate_size, hidden),
            f"{prefix}.mlp.up_proj.weight": (spec.intermediate_size, hidden),
            f"{prefix}.mlp.down_proj.weight": (hidden, spec.intermediate_size),
        }
    return shapes


def _random_tensor(spec: ModelSpec, name: str, shape: tuple[int, ...]) -> torch.Tensor:
    import torch

    if name.endswith("norm.weight"):
        return torch.ones(shape)
    # One generator per tensor, seeded from its name: values do not depend on
    # the order tensors are created in.
    name_seed = hashlib.sha256(f"{spec.seed}:{name}".encode()).digest()
    generator = torch.Generator().manual_seed(int.from_bytes(name_seed[:8], "little"))
    return torch.randn(shape, generator=generator) * _init_std(spec, name, shape)


def _init_std(spec: ModelSpec, name: str, shape: tuple[int, ...]) -> float:
    if name == "model.embed_tokens.weight":
        return spec.embedding_std
    if name == "lm_head.weight":
        return spec.logit_scale / math.sqrt(spec.hidden_size)
    return spec.linear_gain / math.sqrt(shape[1])


def load_corpus() -> str:
    return lzma.decompress(CORPUS_PATH.read_bytes()).decode("utf-8")


def hf_config(spec: ModelSpec) -> dict[str, object]:
    """``config.json`` for ``LlamaForCausalLM``, with rope given both ways for older readers."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": spec.vocab_size,
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "head_dim": spec.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": spec.max_position_embeddings,
        "rms_norm_eps": spec.rms_norm_eps,
        "rope_theta": spec.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": spec.rope_theta},
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "tie_word_embeddings": spec.tie_word_embeddings,
        "initializer_range": 0.02,
        "use_cache": True,
        "torch_dtype": spec.dtype,
        "dtype": spec.dtype,
        **_special_token_ids(),
    }


def _special_token_ids() -> dict[str, int]:
    return {
        "bos_token_id": SPECIAL_TOKENS.index(BOS),
        "eos_token_id": SPECIAL_TOKENS.index(EOS),
        "pad_token_id": SPECIAL_TOKENS.index(PAD),
    }


def _special_tokens_map() -> dict[str, str]:
    return {"bos_token": BOS, "eos_token": EOS, "unk_token": UNK, "pad_token": PAD}


def _tokenizer_config(spec: ModelSpec) -> dict[str, object]:
    # The generic fast class keeps tokenizer.json as written; Llama's own class
    # would rebuild it around a SentencePiece-style pre-tokenizer. BOS comes
    # from tokenizer.json's post-processor. Left padding suits batched generate().
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **_special_tokens_map(),
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": spec.max_position_embeddings,
        "padding_side": "left",
    }


@functools.cache
def fingerprint(spec: ModelSpec) -> str:
    digest = hashlib.sha256()
    digest.update(json.dumps([FORMAT_VERSION, asdict(spec)], sort_keys=True).encode())
    digest.update(CORPUS_PATH.read_bytes())
    return digest.hexdigest()[:10]


def _write_json(path: Path, data: Mapping[str, object]) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
