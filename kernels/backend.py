"""Attention backend selection and dispatch: the torch path, the fused CPU
kernel, or Slipstream's Triton kernels.

``resolve_backend`` turns the user's ``auto|torch|cpu|triton`` into a concrete
name; ``write_kv_for`` / ``paged_attention_for`` / ``copy_blocks_for`` return
callables with the signatures of the torch ones in ``kv_write.py``,
``attention.py`` and ``block_copy.py``, so the model code calls them the same
way whichever runs.

``cpu`` is the fused C++ paged-attention kernel (``cpu_attention.py``); it
needs a C++ compiler once, to build the extension, and a head-major KV cache.
Writing K/V and copying blocks are plain indexing, so it reuses the torch ones.

Triton modules are imported only when the Triton backend is asked for: a
torch-only install never imports triton, and ``TRITON_INTERPRET=1`` set by a
test before that point is seen when the kernels are decorated.

The Triton attention path reads only the backend-neutral metadata fields
(``query_lens``, ``seq_lens``, ``query_start_loc``, ``block_tables``,
``block_size``). What it needs beyond them (per-sequence lengths on the device,
which rows decode) is derived once per step, on the first layer's call, and
reused by the other layers of the same step (see ``triton_step``).
"""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from slipstream.kernels import cpu_attention
from slipstream.kernels.attention import AttentionMetadata

BACKEND_CHOICES = ("auto", "torch", "cpu", "triton")

log = logging.getLogger(__name__)

WriteKV = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata], None
]
PagedAttention = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata, float], torch.Tensor
]
CopyBlocks = Callable[
    [list[tuple[torch.Tensor, torch.Tensor]], list[tuple[torch.Tensor, torch.Tensor]],
     list[tuple[int, int]]],
    None,
]  # fmt: skip


class BackendUnavailable(ValueError):
    """The requested attention backend cannot run on this machine or device."""


def resolve_backend(
    requested: str,
    device: torch.device,
    *,
    home: Path | None = None,
    build_extension: bool = True,
) -> str:
    """``"torch"``, ``"cpu"`` or ``"triton"``. ``auto`` is Triton on CUDA devices
    (when triton is installed); on the CPU it is the fused kernel when its
    extension builds and loads (cached under ``home``, see ``cpu_attention``),
    else torch, said in one log line. ``build_extension=False`` never builds or
    loads it (``auto`` gives torch, ``cpu`` is refused). An explicit ``triton``
    off CUDA is only allowed under the Triton interpreter (``TRITON_INTERPRET=1``)."""
    if requested not in BACKEND_CHOICES:
        raise BackendUnavailable(
            f"unknown attention backend {requested!r}; choose one of {BACKEND_CHOICES}"
        )
    if requested == "torch":
        return "torch"
    if requested == "auto":
        if device.type == "cuda" and is_triton_installed():
            return "triton"
        if device.type == "cpu":
            return "cpu" if _fused_cpu_kernel(home, build_extension) else "torch"
        return "torch"
    if requested == "cpu":
        if device.type != "cpu":
            raise BackendUnavailable(
                f"attention backend 'cpu' runs on the CPU, not {device.type!r}"
            )
        if not build_extension:
            raise BackendUnavailable(
                "attention backend 'cpu' asked for with the extension disabled"
            )
        if not cpu_attention.is_available(home):
            raise BackendUnavailable(
                f"attention backend 'cpu' is unavailable: {cpu_attention.failure()}"
            )
        return "cpu"
    if not is_triton_installed():
        raise BackendUnavailable("attention backend 'triton' needs the triton package")
    if device.type != "cuda" and not is_interpreting():
        raise BackendUnavailable(
            f"attention backend 'triton' runs on CUDA devices, not {device.type!r} "
            "(set TRITON_INTERPRET=1 to run the kernels on the CPU, slowly)"
        )
    return "triton"


def _fused_cpu_kernel(home: Path | None, build_extension: bool) -> bool:
    """Whether ``auto`` may use the fused kernel; a refusal is logged once by its cause."""
    if not build_extension:
        log.info("fused CPU attention kernel disabled; using the torch attention path")
        return False
    return cpu_attention.is_available(home)  # logs its own failure


def is_triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def is_interpreting() -> bool:
    """True when triton runs kernels in its CPU interpreter (read from triton's own knobs)."""
    from triton import knobs

    return bool(knobs.runtime.interpret)


def write_kv_for(backend: str) -> WriteKV:
    if backend == "torch":
        from slipstream.kernels.kv_write import write_kv

        return write_kv
    if backend == "cpu":
        _require_fused_cpu_kernel()
        return cpu_attention.write_kv
    _require_triton(backend)
    from slipstream.kernels.triton_kv_write import triton_write_kv

    return triton_write_kv


def paged_attention_for(backend: str) -> PagedAttention:
    if backend == "torch":
        from slipstream.kernels.attention import paged_attention

        return paged_attention
    if backend == "cpu":
        _require_fused_cpu_kernel()
        return cpu_attention.paged_attention
    _require_triton(backend)
    return triton_paged_attention


def copy_blocks_for(backend: str) -> CopyBlocks:
    if backend in ("torch", "cpu"):
        from slipstream.kernels.block_copy import copy_blocks

        return copy_blocks
    _require_triton(backend)
    from slipstream.kernels.triton_block_copy import triton_copy_blocks

    return triton_copy_blocks


def _require_fused_cpu_kernel() -> None:
    if not cpu_attention.is_available():  # loaded already when resolve_backend chose it
        raise BackendUnavailable(f"the fused CPU kernel is unavailable: {cpu_attention.failure()}")


def _require_triton(backend: str) -> None:
    if backend != "triton":
        raise BackendUnavailable(f"unknown resolved backend {backend!r}; expected torch|cpu|triton")


@dataclass(frozen=True, slots=True)
class TritonStep:
    """Device-side views of one step's batch that the Triton kernels index.

    ``seq_lens`` is int32 ``[B]``. Decode rows (query length 1) are the
    sequences ``decode_seq_ids`` whose single query is row ``decode_token_ids``
    of q; prefill rows are ``prefill_seq_ids``. Each id list is None when empty.
    """

    seq_lens: torch.Tensor
    decode_seq_ids: torch.Tensor | None
    decode_token_ids: torch.Tensor | None
    max_decode_len: int
    prefill_seq_ids: torch.Tensor | None
    max_prefill_query_len: int


# One entry: the step whose layers are running. Holding ``meta`` itself keeps its
# id from being reused by a later step's metadata while the entry is alive.
_last_step: tuple[AttentionMetadata, TritonStep] | None = None


def triton_step(meta: AttentionMetadata) -> TritonStep:
    """The ``TritonStep`` of ``meta``, built on first use and reused for the same
    metadata object (every layer of a step). Single-threaded use (the engine thread)."""
    global _last_step
    if _last_step is not None and _last_step[0] is meta:
        return _last_step[1]
    step = _build_triton_step(meta)
    _last_step = (meta, step)
    return step


def _build_triton_step(meta: AttentionMetadata) -> TritonStep:
    device = meta.query_start_loc.device
    starts = [0]
    for query_len in meta.query_lens:
        starts.append(starts[-1] + query_len)
    decode = [b for b, n in enumerate(meta.query_lens) if n == 1]
    prefill = [b for b, n in enumerate(meta.query_lens) if n > 1]

    def ids(values: list[int]) -> torch.Tensor | None:
        return torch.tensor(values, dtype=torch.int32, device=device) if values else None

    return TritonStep(
        seq_lens=torch.tensor(meta.seq_lens, dtype=torch.int32, device=device),
        decode_seq_ids=ids(decode),
        decode_token_ids=ids([starts[b] for b in decode]),
        max_decode_len=max((meta.seq_lens[b] for b in decode), default=0),
        prefill_seq_ids=ids(prefill),
        max_prefill_query_len=max((meta.query_lens[b] for b in prefill), default=0),
    )


def triton_paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Same contract as ``attention.paged_attention``: decodes go to the paged
    decode kernel (split-K on long contexts), prefill chunks to the prefill kernel."""
    return triton_attention_for_step(q, k_cache, v_cache, meta, triton_step(meta), scale)


def triton_attention_for_step(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    step: TritonStep,
    scale: float,
    out: torch.Tensor | None = None,
    check: bool = True,
) -> torch.Tensor:
    """``triton_paged_attention`` with the step's Triton metadata already built
    (by ``triton_step``, or staged on the device by the GPU runner); into
    ``out`` (q's shape and dtype) where given. ``check`` False skips
    validating the inputs: a step's layers after its first, whose q, caches
    and output differ from the first's in their buffers only (the checks
    cost ~40 us of host time a layer on a Zen 3 core: ~1 ms over SmolLM2's 30)."""
    from slipstream.kernels.triton_paged_decode import paged_decode
    from slipstream.kernels.triton_paged_prefill import paged_prefill

    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if step.decode_seq_ids is not None and step.decode_token_ids is not None:
        paged_decode(
            q, k_cache, v_cache, meta.block_tables, step.seq_lens,
            step.decode_seq_ids, step.decode_token_ids, step.max_decode_len, scale, out,
            check=check,
        )  # fmt: skip
    if step.prefill_seq_ids is not None:
        paged_prefill(
            q, k_cache, v_cache, meta.block_tables, step.seq_lens, meta.query_start_loc,
            step.prefill_seq_ids, step.max_prefill_query_len, scale, out, check=check,
        )  # fmt: skip
    return out


def check_launchable(kernel: object, *tensors: torch.Tensor) -> None:
    """Triton kernels run on CUDA tensors, or on CPU tensors under the interpreter
    (``kernel`` was decorated while ``TRITON_INTERPRET=1``); all on one device."""
    from triton.runtime.interpreter import InterpretedFunction

    devices = {t.device for t in tensors}
    if len(devices) != 1:
        raise ValueError(f"tensors are on several devices: {sorted(map(str, devices))}")
    device = devices.pop()
    interpreted = isinstance(kernel, InterpretedFunction)
    if device.type == "cuda" and not interpreted:
        return
    if device.type == "cpu" and interpreted:
        return
    mode = "the interpreter (TRITON_INTERPRET=1)" if interpreted else "compiled kernels"
    raise ValueError(f"cannot launch {mode} on {device.type} tensors")
