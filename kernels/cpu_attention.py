"""The fused CPU paged-attention kernel (``csrc/paged_attention_cpu.cpp``): build, load, call.

``paged_attention`` has the signature of ``attention.paged_attention`` and
returns the same values (up to fp32 rounding; it never rounds scores to bf16),
reading K/V straight from a head-major pool through the block tables; see the
C++ file for the memory walk. It runs as the torch op
``torch.ops.slipstream.paged_attention``, which has a fake (meta) kernel, so a
model calling it compiles under ``torch.compile(fullgraph=True)``.

Built on first use and cached under ``<home>/cache/extensions`` (see
``extensions``).

``is_available()`` tries the build once per process and never raises: on any
failure it logs one line and returns False, and callers use the torch path.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from slipstream.kernels import cpu_features, extensions
from slipstream.kernels.attention import AttentionMetadata
from slipstream.kernels.cpu_features import CpuFeatures
from slipstream.kernels.extensions import default_home
from slipstream.kernels.kv_layout import cache_head_dim, head_major, stores

SOURCE = Path(__file__).resolve().parent / "csrc" / "paged_attention_cpu.cpp"
# -O3 for the vector loops; -fopenmp for the task loop (it links the libgomp
# torch already loaded); -Wno-psabi: 32-byte vector helpers are always inlined.
EXTENSION = extensions.Extension(
    name="paged_attention_cpu",
    cflags=("-O3", "-fopenmp", "-fno-math-errno", "-Wno-psabi"),
    ldflags=("-fopenmp",),
    probe="paged_attention_cpu_isa",
    what="fused CPU attention kernel",
    fallback="the torch attention path",
    set_max_isa="paged_attention_set_max_isa",
)
DTYPES = (torch.float32, torch.bfloat16)

_fake_registered = False
log = logging.getLogger(__name__)

__all__ = ["default_home", "failure", "is_available", "paged_attention", "write_kv"]


def build_key(source: Path | None = None) -> str:
    return extensions.build_key(EXTENSION, source or SOURCE)


def extension_dir(home: Path, source: Path | None = None) -> Path:
    return extensions.extension_dir(EXTENSION, home, source or SOURCE)


def is_available(home: Path | None = None, source: Path | None = None) -> bool:
    """True once the kernel is loaded. The first call per source (default
    ``SOURCE``) builds or loads it into ``extension_dir(home or default_home())``;
    later calls return that outcome. Failure logs one line and returns False."""
    return extensions.attempt_once(EXTENSION, home or default_home(), source or SOURCE, _after_load)


def failure(source: Path | None = None) -> str | None:
    """Why the attempt for ``source`` failed, None if it succeeded or was not made."""
    return extensions.failure(source or SOURCE)


def _after_load() -> bool:
    """Registers the fake kernel once; sets this CPU's bf16 prefill mode."""
    global _fake_registered
    if not _fake_registered:
        torch.library.register_fake("slipstream::paged_attention", _fake_paged_attention)
        _fake_registered = True
    set_cpu_bf16_prefill()
    return True


def set_cpu_bf16_prefill() -> str:
    """Puts this CPU's bf16 prefill mode in force (``bf16_prefill_for``), or
    the fp32 tiles where that mode is refused (one log line); returns the mode
    in force. Needs ``is_available()`` first."""
    wanted = bf16_prefill_for(cpu_features.detect())
    try:
        return set_bf16_prefill(wanted)
    except RuntimeError as error:  # brgemm refused: oneDNN's check failed on this machine
        log.warning("bf16 prefill %s unavailable (%s); using the fp32 tiles", wanted, error)
        return set_bf16_prefill("tiles")


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
    k_storage, v_storage = _storages(k_cache, v_cache, "reads")
    check(q, k_storage, v_storage, meta)
    return torch.ops.slipstream.paged_attention(
        q,
        k_storage,
        v_storage,
        meta.block_tables,
        meta.seq_lens_t,
        meta.query_start_loc,
        scale,
    )


def bf16_prefill_for(cpu: CpuFeatures) -> str:
    """The bf16 prefill mode the kernel is loaded with on ``cpu``.

    With AMX-BF16 (a Xeon): the brgemm tiles, whose two products oneDNN runs
    on AMX tiles. Chosen without a measurement on such a CPU: there the fp32
    tiles took 5.4 ms (2 threads, bench_cpu_attention --kind prefill, a
    512-token chunk over a 512-token prefix) against 10.4 as dot product rows
    and 9.7 as vdpbf16ps tiles, and torch's own attention, on the same
    oneDNN products, 3.0-3.9 ms with a gather of K/V included. If the
    loader's check of oneDNN's products fails, the fp32 tiles.

    With AVX512-BF16 and no AMX (an AMD Zen 5): the vdpbf16ps tiles, 1.4 ms
    on that case, against 1.8 as brgemm tiles (the same products at the
    same rate, the softmax between them unfused), 2.4 as fp32 tiles and 3.0-4.5
    as dot product rows. Below AVX512-BF16 the mode does nothing."""
    if "amx_bf16" in cpu.flags:
        return "brgemm"
    return "dot-tiles" if "avx512_bf16" in cpu.flags else "dot"


def set_bf16_prefill(mode: str) -> str:
    """How bf16 prefill tasks run on an AVX512-BF16 CPU: ``"dot"`` (dot
    product rows), ``"tiles"`` (tiles over fp32 copies of K/V, as below
    AVX512-BF16), ``"dot-tiles"`` (tiles on vdpbf16ps over K/V in place) or
    ``"brgemm"`` (those tiles' products on oneDNN's batch-reduce GEMM, AMX
    tiles where the CPU has them; refused with a RuntimeError where oneDNN's
    bf16 brgemm does not run or does not give the tiles' products).
    Process-wide; returns the mode in force. Loading the kernel sets
    ``bf16_prefill_for(cpu_features.detect())``; this compares them
    (``bench_cpu_attention --bf16-prefill``). Needs ``is_available()`` first."""
    return str(torch.ops.slipstream.paged_attention_set_bf16_prefill(mode))


def write_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    meta: AttentionMetadata,
) -> None:
    """``kv_write.write_kv`` in the same extension: each (token, kv head) row
    copied, or quantized into an int8 cache (the bytes ``quantize_rows``
    writes), in one call instead of a chain of torch ops per layer."""
    k_storage, v_storage = _storages(k_cache, v_cache, "writes")
    k, v = _packed_heads(k), _packed_heads(v)
    torch.ops.slipstream.paged_kv_write(k, v, k_storage, v_storage, meta.slot_mapping)


def _storages(
    k_cache: torch.Tensor, v_cache: torch.Tensor, verb: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """The head-major storages behind both caches; the kernel knows no other layout."""
    k_storage, v_storage = head_major(k_cache), head_major(v_cache)
    if k_storage is None or v_storage is None:
        raise ValueError(f"the fused CPU kernel {verb} head-major KV caches (kv_layout)")
    return k_storage, v_storage


def storages_of(
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Every layer's K and V head-major storages (what the ops take)."""
    pairs = [_storages(k_cache, v_cache, "reads") for k_cache, v_cache in kv_caches]
    return [k for k, _ in pairs], [v for _, v in pairs]


def _packed_heads(x: torch.Tensor) -> torch.Tensor:
    """``x`` itself when its heads are packed (the model's split of a fused
    projection: any token stride), else a contiguous copy."""
    strides = x.stride()
    return x if strides[-1] == 1 and strides[-2] == x.shape[-1] else x.contiguous()


def check(
    q: torch.Tensor, k_storage: torch.Tensor, v_storage: torch.Tensor, meta: AttentionMetadata
) -> None:
    """What the op needs, as ValueErrors (the op checks again, including the tables).
    Written for a few microseconds per layer: each tensor attribute read costs."""
    if not (q.is_cpu and k_storage.is_cpu and v_storage.is_cpu):
        raise ValueError("the fused CPU kernel runs on CPU tensors")
    dtype, kv_dtype = q.dtype, k_storage.dtype
    if dtype not in DTYPES or not stores(kv_dtype, dtype) or v_storage.dtype != kv_dtype:
        raise ValueError("q and caches must share float32 or bfloat16 (or caches hold int8), "
                         f"got {dtype}, {kv_dtype}")  # fmt: skip
    shape, storage_shape = q.shape, k_storage.shape
    if len(shape) != 3 or storage_shape != v_storage.shape:
        raise ValueError(f"bad shapes q {tuple(shape)}, k/v {tuple(storage_shape)}")
    num_tokens, num_heads, head_dim = shape
    num_kv_heads, _, block_size, _ = storage_shape
    if num_tokens != meta.num_tokens or block_size != meta.block_size:
        raise ValueError("q rows / cache block size do not match the metadata")
    if num_heads % num_kv_heads or head_dim != cache_head_dim(k_storage):
        raise ValueError("num_heads must be a multiple of num_kv_heads, head dims equal")
    strides = q.stride()
    if strides[2] != 1 or strides[1] != head_dim:
        raise ValueError(f"q heads must be packed, got strides {strides}")
