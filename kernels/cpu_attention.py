"""The fused CPU paged-attention kernel (``csrc/paged_attention_cpu.cpp``): build, load, call.

``paged_attention`` has the signature of ``attention.paged_attention`` and
returns the same values (up to fp32 rounding; it never rounds scores to bf16),
reading K/V straight from a head-major pool through the block tables; see the
C++ file for the memory walk. It runs as the torch op
``torch.ops.slipstream.paged_attention``, which has a fake (meta) kernel, so a
model calling it compiles under ``torch.compile(fullgraph=True)``.

Build and cache (ninja through ``torch.utils.cpp_extension``)::

    <home>/cache/extensions/
        paged_attention_cpu-<key>/      build.ninja, *.o, slipstream_paged_attention_cpu.so
        .paged_attention_cpu-<key>.lock held while one process builds

``<key>`` hashes the source, the compiler flags, the torch version and the
machine architecture. No CPU feature flags: the library holds an AVX2+FMA and a
baseline variant and picks one at run time, so one build serves every x86-64
CPU. ``home`` is the caller's (the service's ``slipstream_home()``, which
honours ``$SLIPSTREAM_HOME``); this module reads no environment variables. A
library left broken in its directory (say, a link killed half-way) makes the
attempt fail with that directory in the log line; deleting it rebuilds.

``is_available()`` tries the build once per process and never raises: on any
failure it logs one line and returns False, and callers use the torch path.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import platform
import time
from pathlib import Path

import torch

from slipstream.kernels.attention import AttentionMetadata
from slipstream.kernels.kv_layout import head_major

log = logging.getLogger(__name__)

SOURCE = Path(__file__).resolve().parent / "csrc" / "paged_attention_cpu.cpp"
LIBRARY_NAME = "slipstream_paged_attention_cpu"
# -O3 for the vector loops; -fopenmp for the task loop (it links the libgomp
# torch already loaded); -Wno-psabi: 32-byte vector helpers are always inlined.
CFLAGS = ("-O3", "-fopenmp", "-fno-math-errno", "-Wno-psabi")
LDFLAGS = ("-fopenmp",)
DTYPES = (torch.float32, torch.bfloat16)

# Outcome of the one build attempt per source file: True, or the failure message.
_attempts: dict[Path, bool | str] = {}
_fake_registered = False


def default_home() -> Path:
    """Where the service keeps its files when ``$SLIPSTREAM_HOME`` is unset."""
    return Path.home() / ".cache" / "slipstream"


def build_key(source: Path | None = None) -> str:
    """Changes whenever the built library could: source, flags, torch, architecture."""
    digest = hashlib.sha256((source or SOURCE).read_bytes())
    for part in (*CFLAGS, *LDFLAGS, torch.__version__, platform.machine()):
        digest.update(b"\0" + part.encode())
    return f"paged_attention_cpu-{digest.hexdigest()[:16]}"


def extension_dir(home: Path, source: Path | None = None) -> Path:
    return home / "cache" / "extensions" / build_key(source)


def load(build_dir: Path, source: Path | None = None) -> None:
    """Builds the library into ``build_dir`` unless it is there, and loads it.
    Raises on failure. One process builds at a time (a kernel lock, so a killed
    build leaves no stale lock behind)."""
    library = build_dir / f"{LIBRARY_NAME}.so"
    build_dir.parent.mkdir(parents=True, exist_ok=True)
    with open(build_dir.parent / f".{build_dir.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not library.exists():
            _build(build_dir, source or SOURCE)
    torch.ops.load_library(str(library))
    _register_fake()


def _build(build_dir: Path, source: Path) -> None:
    from torch.utils import cpp_extension

    build_dir.mkdir(parents=True, exist_ok=True)
    # torch's own lock file; under our lock, one left here is from a killed build.
    (build_dir / "lock").unlink(missing_ok=True)
    cpp_extension.load(
        name=LIBRARY_NAME,
        sources=[str(source)],
        extra_cflags=list(CFLAGS),
        extra_ldflags=list(LDFLAGS),
        build_directory=str(build_dir),
        is_python_module=False,
        verbose=False,
    )


def is_available(home: Path | None = None, source: Path | None = None) -> bool:
    """True once the kernel is loaded. The first call per source (default
    ``SOURCE``) builds or loads it into ``extension_dir(home or default_home())``;
    later calls return that outcome. Failure logs one line and returns False."""
    source = source or SOURCE
    outcome = _attempts.get(source)
    if outcome is None:
        outcome = _attempt(extension_dir(home or default_home(), source), source)
        _attempts[source] = outcome
    return outcome is True


def failure(source: Path | None = None) -> str | None:
    """Why the attempt for ``source`` failed, None if it succeeded or was not made."""
    outcome = _attempts.get(source or SOURCE)
    return outcome if isinstance(outcome, str) else None


def _attempt(build_dir: Path, source: Path) -> bool | str:
    started = time.perf_counter()
    try:
        load(build_dir, source)
        isa = torch.ops.slipstream.paged_attention_cpu_isa()
    except Exception as error:  # a failed build must never take the service down
        reason = _first_error_line(error)
        log.warning(
            "fused CPU attention kernel unavailable (%s in %s); using the torch attention path",
            reason,
            build_dir,
        )
        return reason
    log.info(
        "fused CPU attention kernel ready: %s variant, %s (%.1f s)",
        isa,
        build_dir,
        time.perf_counter() - started,
    )
    return True


def _first_error_line(error: Exception) -> str:
    """The compiler's first ``error:`` line if there is one, else the exception's first line."""
    text = str(error)
    for line in text.splitlines():
        if "error:" in line:
            return f"build failed: {line.strip()}"
    first = text.strip().splitlines()[0] if text.strip() else ""
    return f"{type(error).__name__}: {first}"


def _register_fake() -> None:
    global _fake_registered
    if not _fake_registered:
        torch.library.register_fake("slipstream::paged_attention", _fake_paged_attention)
        _fake_registered = True


def _fake_paged_attention(
    q: torch.Tensor,
    k_storage: torch.Tensor,
    v_storage: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    isa: str = "auto",
) -> torch.Tensor:
    """What tracing sees: a fresh contiguous tensor shaped and typed like q."""
    return q.new_empty(q.shape)


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """``attention.paged_attention`` on the fused kernel. ``k_cache``/``v_cache``
    are logical views of head-major storage; ``q [T, num_heads, head_dim]`` may
    have any token stride but packed heads. Needs ``is_available()`` first."""
    k_storage, v_storage = head_major(k_cache), head_major(v_cache)
    if k_storage is None or v_storage is None:
        raise ValueError("the fused CPU kernel reads head-major KV caches (kv_layout)")
    _check(q, k_storage, v_storage, meta)
    return torch.ops.slipstream.paged_attention(
        q,
        k_storage,
        v_storage,
        meta.block_tables,
        meta.seq_lens_t,
        meta.query_start_loc,
        scale,
    )


def _check(
    q: torch.Tensor, k_storage: torch.Tensor, v_storage: torch.Tensor, meta: AttentionMetadata
) -> None:
    """What the op needs, as ValueErrors (the op checks again, including the tables).
    Written for a few microseconds per layer: each tensor attribute read costs."""
    if not (q.is_cpu and k_storage.is_cpu and v_storage.is_cpu):
        raise ValueError("the fused CPU kernel runs on CPU tensors")
    dtype = q.dtype
    if dtype not in DTYPES or k_storage.dtype != dtype or v_storage.dtype != dtype:
        raise ValueError(f"q and caches must share float32 or bfloat16, got {dtype}, "
                         f"{k_storage.dtype}")  # fmt: skip
    shape, storage_shape = q.shape, k_storage.shape
    if len(shape) != 3 or storage_shape != v_storage.shape:
        raise ValueError(f"bad shapes q {tuple(shape)}, k/v {tuple(storage_shape)}")
    num_tokens, num_heads, head_dim = shape
    num_kv_heads, _, block_size, cache_head_dim = storage_shape
    if num_tokens != meta.num_tokens or block_size != meta.block_size:
        raise ValueError("q rows / cache block size do not match the metadata")
    if num_heads % num_kv_heads or head_dim != cache_head_dim:
        raise ValueError("num_heads must be a multiple of num_kv_heads, head dims equal")
    strides = q.stride()
    if strides[2] != 1 or strides[1] != head_dim:
        raise ValueError(f"q heads must be packed, got strides {strides}")
