"""KV block moves for a device runner: swaps between the device pool and the
pinned host pool on their own CUDA stream, and copy-on-write copies within
the device pool, none of which waits on the host.

Swap out (device -> host), in stream order::

    copy stream:    wait(compute) ─ gather blocks ─●─ one D2H copy to pinned ─● done
    compute stream:                 wait(gathered)─┘ forward may now reuse the device blocks

The gathered blocks land in the host pool later (``land``): before the next
swap-in reads the host pool, or whenever asked; by then the copy has long
finished. Swap in (host -> device): the host gathers the blocks into one
pinned buffer, the copy stream sends it and scatters it into the device pool,
and the compute stream waits for that before the forward reads them.

On the CPU the same code runs without streams or events (tests use it).
"""

from __future__ import annotations

import contextlib
import math
import mmap
from dataclasses import dataclass

import torch

from slipstream.kernels.kv_layout import block_view

KVPool = list[tuple[torch.Tensor, torch.Tensor]]


@dataclass(slots=True)
class _PendingSwapOut:
    host_ids: torch.Tensor  # int64 on the CPU
    blocks: torch.Tensor  # [2 * layers, *gathered block shape] on the CPU (pinned)
    done: torch.cuda.Event | None


class BlockSwapper:
    """Moves whole blocks for one ``(device_pool, host_pool)`` pair. Both pools
    hold one layout (``kv_layout``); pairs follow ``StepPlan``: swap_out
    ``(device, host)``, swap_in ``(host, device)``, copies ``(src, dst)``."""

    def __init__(self, device_pool: KVPool, host_pool: KVPool, device: torch.device) -> None:
        self.device_pool = device_pool
        self.host_pool = host_pool
        self.device = device
        self._is_cuda = device.type == "cuda"
        self._stream = torch.cuda.Stream(device) if self._is_cuda else None
        self._pending: list[_PendingSwapOut] = []
        self._device_stores = _stores(device_pool)
        self._host_stores = _stores(host_pool)
        dims = {dim for _, dim in self._device_stores + self._host_stores}
        if len(dims) != 1:
            raise ValueError("the device and host pools have different layouts")
        self._dim = dims.pop()

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        if not pairs:
            return
        compute = self._current_stream()
        with self._on_copy_stream():
            if self._stream is not None and compute is not None:
                self._stream.wait_stream(compute)
            device_ids = self._device_ids([d for d, _ in pairs])
            gathered = self._gather(self._device_stores, device_ids, self.device)
            gathered_event = self._record()
            blocks = torch.empty(gathered.shape, dtype=gathered.dtype, pin_memory=self._is_cuda)
            blocks.copy_(gathered, non_blocking=True)
            done = self._record()
        if compute is not None and gathered_event is not None:
            compute.wait_event(gathered_event)
        host_ids = torch.tensor([h for _, h in pairs], dtype=torch.int64)
        self._pending.append(_PendingSwapOut(host_ids, blocks, done))
        if not self._is_cuda:
            self.land()

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        if not pairs:
            return
        self.land()
        host_ids = torch.tensor([h for h, _ in pairs], dtype=torch.int64)
        blocks = self._gather(self._host_stores, host_ids, torch.device("cpu"))
        compute = self._current_stream()
        with self._on_copy_stream():
            if self._stream is not None and compute is not None:
                self._stream.wait_stream(compute)
            device_ids = self._device_ids([d for _, d in pairs])
            on_device = blocks.to(self.device, non_blocking=True)
            for i, (store, _) in enumerate(self._device_stores):
                store.index_copy_(self._dim, device_ids, on_device[i])
            done = self._record()
        if compute is not None and done is not None:
            compute.wait_event(done)

    def _gather(
        self, stores: list[tuple[torch.Tensor, int]], ids: torch.Tensor, device: torch.device
    ) -> torch.Tensor:
        """``[2 * layers, *one store's blocks ids]`` in one buffer (pinned when it is
        the host's and a GPU will read it): every layer's K and V blocks ``ids``."""
        shape = list(stores[0][0].shape)
        shape[self._dim] = ids.shape[0]
        pin = self._is_cuda and device.type == "cpu"
        out = torch.empty(
            (len(stores), *shape), dtype=stores[0][0].dtype, device=device, pin_memory=pin
        )
        for i, (store, _) in enumerate(stores):
            torch.index_select(store, self._dim, ids, out=out[i])
        return out

    def copy(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write within the device pool, on the compute stream: sources
        are gathered before any destination is written (``block_copy``'s contract)."""
        if not pairs:
            return
        src = self._device_ids([s for s, _ in pairs])
        dst = self._device_ids([d for _, d in pairs])
        for store, _ in self._device_stores:
            store.index_copy_(self._dim, dst, store.index_select(self._dim, src))

    def land(self) -> None:
        """Writes finished swap-outs into the host pool (waits for their copies)."""
        for pending in self._pending:
            if pending.done is not None:
                pending.done.synchronize()
            for i, (store, _) in enumerate(self._host_stores):
                store.index_copy_(self._dim, pending.host_ids, pending.blocks[i])
        self._pending.clear()

    def _device_ids(self, ids: list[int]) -> torch.Tensor:
        """``ids`` on the device, sent on the current stream without waiting."""
        host = torch.tensor(ids, dtype=torch.int64, pin_memory=self._is_cuda)
        return host.to(self.device, non_blocking=True)

    def _current_stream(self) -> torch.cuda.Stream | None:
        return torch.cuda.current_stream(self.device) if self._is_cuda else None

    def _on_copy_stream(self) -> contextlib.AbstractContextManager[object]:
        if self._stream is None:
            return contextlib.nullcontext()
        return torch.cuda.stream(self._stream)

    def _record(self) -> torch.cuda.Event | None:
        if self._stream is None:
            return None
        event = torch.cuda.Event()
        event.record(self._stream)
        return event


def _stores(pool: KVPool) -> list[tuple[torch.Tensor, int]]:
    """Each layer's K then V as contiguous storage and its block dim."""
    return [block_view(cache) for layer in pool for cache in layer]


def allocate_host_pool(
    num_layers: int,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    pin_memory: bool,
) -> KVPool:
    """A head-major host pool (``kv_layout``); pinned when ``pin_memory``, by
    registering memory of its own with CUDA: torch's pinned allocator rounds
    every allocation up to a power of two, up to twice a large pool."""
    shape = (num_kv_heads, num_blocks, block_size, head_dim)

    def cache() -> torch.Tensor:
        storage = _registered(shape, dtype) if pin_memory else torch.zeros(shape, dtype=dtype)
        return storage.permute(1, 2, 0, 3)

    return [(cache(), cache()) for _ in range(num_layers)]


class _RegisteredMap(mmap.mmap):
    """An anonymous map page-locked with ``cudaHostRegister`` and unregistered
    when the last tensor over it goes, before it is unmapped: an address range
    left registered after ``free`` would make CUDA treat whatever is allocated
    there next as pinned memory it no longer is (copies from it then fail with
    "invalid argument", registering it with "already mapped")."""

    address = 0

    def __del__(self) -> None:
        if self.address:
            torch.cuda.cudart().cudaHostUnregister(self.address)


def _registered(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Zeroed ``shape`` memory, page-locked in place, or pinned by torch where
    registering fails."""
    num_bytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if num_bytes == 0:
        return torch.zeros(shape, dtype=dtype)
    buffer = _RegisteredMap(-1, num_bytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    storage = torch.frombuffer(buffer, dtype=torch.uint8).view(dtype).view(shape)
    if int(torch.cuda.cudart().cudaHostRegister(storage.data_ptr(), num_bytes, 0)) == 0:
        buffer.address = storage.data_ptr()
        return storage
    # The failed call left its error as CUDA's last error, which the next
    # kernel launch check would report as its own: take it here.
    with contextlib.suppress(RuntimeError):
        torch.zeros(1, device="cuda")
    return torch.zeros(shape, dtype=dtype, pin_memory=True)
