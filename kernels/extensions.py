"""Native kernels built on first use with ``torch.utils.cpp_extension`` and
cached, one library per source file::

    <home>/cache/extensions/
        <name>-<key>/      build.ninja, *.o, slipstream_<name>.so
        .<name>-<key>.lock held while one process builds

``<key>`` hashes the source, the headers beside it, the compiler flags, the
torch version and the machine architecture. Under the ``avx512-emulated``
CPU answer (``cpu_answer.py``) every library is the emulating test build:
one more flag, so another key. No CPU feature flags: each library holds several
instruction-set variants (AVX-512, AVX2+FMA, baseline) and picks one at run
time, so one build serves every x86-64 CPU. The library checks CPUID; before
it is probed, Python caps its choice at ``max_isa(cpu_features.detect())``,
so a forced ``detect()`` answer (an AVX2-only CPU, say) is never exceeded.
``home`` is the caller's (the service's ``slipstream_home()``, which
honours ``$SLIPSTREAM_HOME``); this module reads no environment variables.
A library left broken in its directory (say, a link killed
half-way) makes the attempt fail with that directory in the log line;
deleting it rebuilds.

``attempt()`` tries one build per process and source and never raises: on any
failure it logs one line naming the fallback and returns the reason.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import platform
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from slipstream.kernels import cpu_features
from slipstream.kernels.cpu_answer import EMULATED_AVX512

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Extension:
    """One source file's library. ``probe`` names an op of the library that
    returns the instruction-set variant it picked (proves it loaded)."""

    name: str
    cflags: tuple[str, ...]
    ldflags: tuple[str, ...]
    probe: str
    what: str  # for log lines, e.g. "fused CPU attention kernel"
    fallback: str  # e.g. "the torch attention path"
    # An op ``(str isa) -> str`` capping the variant the library picks, called
    # with ``max_isa(...)`` before the probe; None: the library picks alone.
    set_max_isa: str | None = None

    @property
    def library_name(self) -> str:
        return f"slipstream_{self.name}"


def default_home() -> Path:
    """Where the service keeps its files when ``$SLIPSTREAM_HOME`` is unset."""
    return Path.home() / ".cache" / "slipstream"


EMULATE_AVX512_FLAG = "-DSLIPSTREAM_EMULATE_AVX512"


def cflags(ext: Extension) -> tuple[str, ...]:
    """``ext``'s compiler flags, and the emulating test build's under the
    ``avx512-emulated`` CPU answer."""
    if cpu_features.forced() == EMULATED_AVX512:
        # -O1: the emulated intrinsics, inlined and unrolled at -O3, took the
        # attention library 6 minutes to compile; a test build needs no speed.
        return (*ext.cflags, EMULATE_AVX512_FLAG, "-O1")
    return ext.cflags


def build_key(ext: Extension, source: Path) -> str:
    """Changes whenever the built library could: source and the headers
    beside it, flags, torch, architecture."""
    digest = hashlib.sha256(source.read_bytes())
    for header in sorted(source.parent.glob("*.h")):
        digest.update(header.read_bytes())
    for part in (*cflags(ext), *ext.ldflags, torch.__version__, platform.machine()):
        digest.update(b"\0" + part.encode())
    return f"{ext.name}-{digest.hexdigest()[:16]}"


def extension_dir(ext: Extension, home: Path, source: Path) -> Path:
    return home / "cache" / "extensions" / build_key(ext, source)


def load(ext: Extension, build_dir: Path, source: Path) -> None:
    """Builds the library into ``build_dir`` unless it is there, and loads it.
    Raises on failure. One process builds at a time (a kernel lock, so a killed
    build leaves no stale lock behind)."""
    library = build_dir / f"{ext.library_name}.so"
    build_dir.parent.mkdir(parents=True, exist_ok=True)
    with open(build_dir.parent / f".{build_dir.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not library.exists():
            _build(ext, build_dir, source)
    torch.ops.load_library(str(library))


def _build(ext: Extension, build_dir: Path, source: Path) -> None:
    from torch.utils import cpp_extension

    build_dir.mkdir(parents=True, exist_ok=True)
    # torch's own lock file; under our lock, one left here is from a killed build.
    (build_dir / "lock").unlink(missing_ok=True)
    cpp_extension.load(
        name=ext.library_name,
        sources=[str(source)],
        extra_cflags=list(cflags(ext)),
        extra_ldflags=list(ext.ldflags),
        build_directory=str(build_dir),
        is_python_module=False,
        verbose=False,
    )


def max_isa(features: cpu_features.CpuFeatures) -> str:
    """The widest variant a library may pick on a CPU that reports ``features``:
    "avx512" only with avx512f among its flags, "avx2" with avx2, else
    "portable". The library may pick less (it also checks CPUID: FMA,
    AVX512-BW/VL/DQ, AVX512-BF16 where a variant needs them)."""
    if "avx512f" in features.flags:
        return "avx512"
    return "avx2" if "avx2" in features.flags else "portable"


def cap_isa(ext: Extension, features: cpu_features.CpuFeatures | None = None) -> str | None:
    """Caps a loaded library at ``max_isa(features)`` (default ``detect()``);
    returns the variant it now picks, None for a library without a cap."""
    if ext.set_max_isa is None:
        return None
    cap = max_isa(features if features is not None else cpu_features.detect())
    return str(getattr(torch.ops.slipstream, ext.set_max_isa)(cap))


def attempt(ext: Extension, home: Path, source: Path) -> bool | str:
    """Build or load, cap the variant, then probe: True, or why not (logged once)."""
    build_dir = extension_dir(ext, home, source)
    started = time.perf_counter()
    try:
        load(ext, build_dir, source)
        cap_isa(ext)
        isa = getattr(torch.ops.slipstream, ext.probe)()
    except Exception as error:  # a failed build must never take the service down
        reason = _first_error_line(error)
        log.warning("%s unavailable (%s in %s); using %s", ext.what, reason, build_dir,
                    ext.fallback)  # fmt: skip
        return reason
    log.info("%s ready: %s variant, %s (%.1f s)", ext.what, isa, build_dir,
             time.perf_counter() - started)  # fmt: skip
    return True


# One outcome per source file and process: True, or why not.
_outcomes: dict[Path, bool | str] = {}


def attempt_once(
    ext: Extension, home: Path, source: Path, after_load: Callable[[], bool | str] | None = None
) -> bool:
    """``attempt`` on the first call for ``source``; later calls return its
    outcome. ``after_load`` runs once the library loaded (register fakes,
    check the variant) and may turn the outcome into a reason not to use it."""
    outcome = _outcomes.get(source)
    if outcome is None:
        outcome = attempt(ext, home, source)
        if outcome is True and after_load is not None:
            outcome = after_load()
        _outcomes[source] = outcome
    return outcome is True


def failure(source: Path) -> str | None:
    """Why the attempt for ``source`` failed; None if it succeeded or was not made."""
    outcome = _outcomes.get(source)
    return outcome if isinstance(outcome, str) else None


def _first_error_line(error: Exception) -> str:
    """The compiler's first ``error:`` line if there is one, else the exception's first line."""
    text = str(error)
    for line in text.splitlines():
        if "error:" in line:
            return f"build failed: {line.strip()}"
    first = text.strip().splitlines()[0] if text.strip() else ""
    return f"{type(error).__name__}: {first}"
