"""Step metadata staged on the host and sent to the device in one copy.

Everything a step's kernels index (token ids, positions, slot mapping, block
tables, sequence lengths, query starts, which rows decode, which rows sample
and how, a seeded row's draw) is written by the host into one flat int64
buffer (pinned on a CUDA machine) and copied to its device twin with one
``copy_(non_blocking=True)``. Each field is a fixed region; int32, float32
and float64 fields are views over int64 words. The device twin's regions
never move, so a CUDA graph captured over them reads each step's values
after that one copy::

    word 0                                                          end(B)     total
    | num_rows | per-seq | token_ids | positions | slot_mapping | block_tables 0..B-1 | ...
                 fields    (max_num_tokens each)                  (max_blocks_per_seq wide)
                 (max_num_seqs each)

A step with B rows copies words ``0 .. end(B)``: block tables come last, so
the copy grows with the rows used, not with the capacity.

Nothing here knows the device: the layout and the builder are tested on the CPU.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import NoReturn

import numpy as np
import torch

from slipstream.kernels.device_sampling import SamplingPlan, plan_sampling
from slipstream.kernels.sampling_primitives import seeded_draws
from slipstream.scheduler.plan import PENDING_TOKEN, StepPlan

# (name, dtype, entries per sequence or per token); block_tables is sized apart.
_PER_SEQ: tuple[tuple[str, torch.dtype], ...] = (
    ("seq_lens", torch.int64),
    ("seq_lens_i32", torch.int32),
    ("decode_seq_ids", torch.int32),
    ("decode_token_ids", torch.int32),
    ("prefill_seq_ids", torch.int32),
    ("sample_indices", torch.int64),
    ("sample_rows", torch.int64),
    ("temperatures", torch.float32),
    ("top_ks", torch.int64),
    ("top_ps", torch.float32),
    ("min_ps", torch.float32),
    ("unseeded", torch.int64),
    ("seeded", torch.int64),
    ("seeded_uniforms", torch.float64),
    ("pending_positions", torch.int64),
    ("pending_rows", torch.int64),
)
_PER_TOKEN = ("token_ids", "positions", "slot_mapping")
_ALIGN_WORDS = 8  # 64-byte regions: every view is aligned as a fresh allocation would be


@dataclass(frozen=True, slots=True)
class Region:
    offset: int  # in int64 words
    numel: int  # in elements of dtype
    dtype: torch.dtype


@dataclass(frozen=True, slots=True)
class StagingLayout:
    """Where each field lives in the flat int64 buffer."""

    max_num_tokens: int
    max_num_seqs: int
    max_blocks_per_seq: int
    regions: dict[str, Region]
    total_words: int

    @classmethod
    def build(
        cls, max_num_tokens: int, max_num_seqs: int, max_blocks_per_seq: int
    ) -> StagingLayout:
        if min(max_num_tokens, max_num_seqs, max_blocks_per_seq) < 1:
            raise ValueError("staging capacities must be positive")
        regions: dict[str, Region] = {}
        offset = 0

        def add(name: str, numel: int, dtype: torch.dtype) -> None:
            nonlocal offset
            regions[name] = Region(offset, numel, dtype)
            words = -(-numel * dtype.itemsize // 8)
            offset += -(-words // _ALIGN_WORDS) * _ALIGN_WORDS

        add("num_rows", 1, torch.int64)
        add("query_start_loc", max_num_seqs + 1, torch.int64)
        for name, dtype in _PER_SEQ:
            add(name, max_num_seqs, dtype)
        for name in _PER_TOKEN:
            add(name, max_num_tokens, torch.int64)
        add("block_tables", max_num_seqs * max_blocks_per_seq, torch.int64)
        return cls(max_num_tokens, max_num_seqs, max_blocks_per_seq, regions, offset)

    def end(self, num_rows: int) -> int:
        """Words to copy for a step of ``num_rows`` rows (block tables are last)."""
        table = self.regions["block_tables"]
        return table.offset + num_rows * self.max_blocks_per_seq

    def views(self, buffer: torch.Tensor) -> dict[str, torch.Tensor]:
        """Typed views of ``buffer`` (flat int64, ``total_words`` long);
        ``block_tables`` is ``[max_num_seqs, max_blocks_per_seq]``."""
        if buffer.dtype != torch.int64 or buffer.shape != (self.total_words,):
            raise ValueError(f"expected a flat int64 buffer of {self.total_words} words")
        out = {}
        for name, region in self.regions.items():
            words = -(-region.numel * region.dtype.itemsize // 8)
            view = buffer[region.offset : region.offset + words].view(region.dtype)[: region.numel]
            out[name] = view
        out["block_tables"] = out["block_tables"].view(self.max_num_seqs, self.max_blocks_per_seq)
        return out


class StagingBuffers:
    """The host buffers (pinned when ``pin_memory``), their device twin, and
    typed views of both. ``upload`` is the step's one host-to-device copy.

    There are two host buffers, used in turn: a step is staged into one while
    the previous step's copy out of the other may still be queued (a plan
    made ahead of its predecessor's results). ``host``, ``host_views`` and
    ``host_arrays`` are the buffer the next step is staged into."""

    def __init__(
        self, layout: StagingLayout, device: torch.device, pin_memory: bool, num_host: int = 2
    ) -> None:
        self.layout = layout
        self._hosts = [
            torch.zeros(layout.total_words, dtype=torch.int64, pin_memory=pin_memory)
            for _ in range(num_host)
        ]
        self._host_views = [layout.views(host) for host in self._hosts]
        # numpy over the same memory: filling from Python lists without a tensor per field
        self._host_arrays: list[dict[str, np.ndarray]] = [
            {name: view.numpy() for name, view in views.items()} for views in self._host_views
        ]
        # Per host buffer, the block list each table row last had written
        # (None: unknown): a row gets only the blocks it gained since.
        self._table_rows: list[list[list[int] | None]] = [
            [None] * layout.max_num_seqs for _ in range(num_host)
        ]
        self._current = 0
        self.device = torch.zeros(layout.total_words, dtype=torch.int64, device=device)
        self.device_views = layout.views(self.device)

    @property
    def host(self) -> torch.Tensor:
        return self._hosts[self._current]

    @property
    def host_views(self) -> dict[str, torch.Tensor]:
        return self._host_views[self._current]

    @property
    def host_arrays(self) -> dict[str, np.ndarray]:
        return self._host_arrays[self._current]

    def write_block_tables(self, tables: list[list[int]], num_rows: int) -> None:
        """Puts ``tables[b]`` at the start of block-table row ``b`` of the
        buffer being staged, and block 0 in each padding row up to
        ``num_rows``. A decode's table grows by a block every ``block_size``
        tokens and keeps its row while the batch is unchanged, so most rows
        already hold their table in this buffer and get nothing written, or
        only the blocks they gained; any other row is written whole. The
        tables are written only through here, or the record of what each
        row holds goes stale."""
        table = self._host_arrays[self._current]["block_tables"]
        written = self._table_rows[self._current]
        for row, blocks in enumerate(tables):
            before = written[row]
            if before is None or blocks[: len(before)] != before:
                table[row, : len(blocks)] = blocks
            elif len(blocks) > len(before):
                table[row, len(before) : len(blocks)] = blocks[len(before) :]
            written[row] = blocks
        table[len(tables) : num_rows, 0] = 0
        written[len(tables) : num_rows] = [None] * (num_rows - len(tables))

    def upload(self, num_rows: int) -> None:
        """Copies the fields of a ``num_rows``-row step; non-blocking from pinned
        memory, so the host goes on while the copy engine works, then turns to
        the other host buffer. A buffer is staged into again two uploads later:
        the runner must have waited for a step between (it waits for every
        step's sampled ids before launching the step after next)."""
        end = self.layout.end(num_rows)
        self.device[:end].copy_(self.host[:end], non_blocking=True)
        self._current = (self._current + 1) % len(self._hosts)


@dataclass(frozen=True, slots=True)
class StagedStep:
    """What the host knows of a staged step (no device reads needed).

    Rows ``0 .. num_seqs`` are the plan's sequences in order; a decode-only
    step padded for a CUDA graph has ``num_rows > num_seqs`` padding rows after
    them (one token each, no KV write, length 1). ``sampled_req_ids[i]`` owns
    logits row ``sample_indices[i]`` (a token index; in a decode-only step
    also its row index).
    """

    num_seqs: int
    num_rows: int
    num_tokens: int
    query_lens: list[int]
    seq_lens: list[int]
    num_decodes: int
    num_prefills: int
    max_decode_len: int
    max_prefill_query_len: int
    sampled_req_ids: list[str]
    sampling: SamplingPlan
    # Rows whose token is the previous step's sample, staged as token 0 with
    # its place (``pending_positions``, ``pending_rows``): the runner puts the
    # token in on the device (``resolve_pending_tokens``).
    num_pending: int = 0
    # Tokens staged: num_tokens, then padding tokens no row owns up to this
    # many (token 0 at position 0, slot -1), for a step run at a padded size.
    padded_tokens: int = 0

    @property
    def is_decode_only(self) -> bool:
        return self.num_prefills == 0


def is_decode_only(plan: StepPlan) -> bool:
    return all(len(seq.token_ids) == 1 for seq in plan.seqs)


def stage_step(
    plan: StepPlan,
    buffers: StagingBuffers,
    block_size: int,
    vocab_size: int,
    pad_to: int | None = None,
    previous_rows: Mapping[str, int] | None = None,
    pad_tokens_to: int | None = None,
) -> StagedStep:
    """Writes ``plan``'s batch into the host buffer. ``pad_to`` (decode-only
    steps) adds padding rows up to that many rows: token 0 at position 0,
    slot -1 (the KV write skips it), length 1 over block 0 (read, never written).
    ``pad_tokens_to`` (any step, not with ``pad_to``) adds padding tokens up
    to that many tokens, owned by no row: token 0 at position 0, slot -1;
    the attention never reads them as queries. It also pads
    ``sample_indices`` with token 0 up to ``sampled_rows_for`` the padded
    tokens: a graph that gathers that many rows reads staged tokens only.
    ``previous_rows``: req_id -> row of the previous step's sampled ids, for
    the plan's ``PENDING_TOKEN``s (a plan made ahead of that step's results):
    each is staged as token 0 with its position among the step's tokens and
    that row, for ``resolve_pending_tokens``."""
    layout = buffers.layout
    arrays = buffers.host_arrays
    num_seqs = len(plan.seqs)
    num_rows = num_seqs if pad_to is None else pad_to
    if num_rows < num_seqs or num_rows > layout.max_num_seqs:
        raise ValueError(
            f"a step of {num_seqs} sequences padded to {num_rows} rows does not fit "
            f"{layout.max_num_seqs} staged rows"
        )
    if pad_to is not None and pad_tokens_to is not None:
        raise ValueError("a step is padded by rows or by tokens, not both")
    max_blocks = layout.max_blocks_per_seq
    token_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    query_lens: list[int] = []
    seq_lens: list[int] = []
    starts = [0]
    sample_indices: list[int] = []
    sampled = []
    tables = []
    decode: list[int] = []  # rows of one token
    prefill: list[int] = []
    max_decode_len = max_prefill_len = 0
    pending_positions: list[int] = []  # a pending token's index among the step's tokens
    pending_rows: list[int] = []  # its sample's row in the previous step's ids
    # Bound methods: this loop runs per sequence per step.
    add_token, add_position, add_slot = token_ids.append, positions.append, slots.append
    add_query_len, add_seq_len, add_start = query_lens.append, seq_lens.append, starts.append
    add_table, add_decode = tables.append, decode.append
    end = 0  # tokens staged so far
    for row, seq in enumerate(plan.seqs):
        tokens, start, blocks = seq.token_ids, seq.start_pos, seq.block_ids
        num_new = len(tokens)
        end_pos = start + num_new
        if len(blocks) > max_blocks or len(blocks) * block_size < end_pos:
            _refuse_blocks(seq.req_id, len(blocks), max_blocks)
        if num_new == 1:  # a decode (or a one-token chunk): most rows of a large step
            if tokens[0] == PENDING_TOKEN:
                add_token(0)  # put in on the device: ``resolve_pending_tokens``
                pending_positions.append(end)
                pending_rows.append(_pending_row(previous_rows, seq.req_id))
            else:
                add_token(tokens[0])
            add_position(start)
            add_slot(blocks[start // block_size] * block_size + start % block_size)
            add_decode(row)
            if end_pos > max_decode_len:
                max_decode_len = end_pos
        else:
            if pad_to is not None:
                raise ValueError("only decode-only steps are padded")
            token_ids.extend(tokens)
            positions.extend(range(start, end_pos))
            slots.extend(
                blocks[pos // block_size] * block_size + pos % block_size
                for pos in range(start, end_pos)
            )
            prefill.append(row)
            if num_new > max_prefill_len:
                max_prefill_len = num_new
        add_query_len(num_new)
        add_seq_len(end_pos)
        add_table(blocks)
        end += num_new
        add_start(end)
        if seq.sample:
            sample_indices.append(end - 1)
            sampled.append(seq)
    num_pad = num_rows - num_seqs
    if max(end + num_pad, pad_tokens_to or 0) > layout.max_num_tokens:
        raise ValueError(
            f"{max(end + num_pad, pad_tokens_to or 0)} tokens exceed the "
            f"{layout.max_num_tokens} staged"
        )
    buffers.write_block_tables(tables, num_rows)
    token_ids.extend([0] * num_pad)
    positions.extend([0] * num_pad)
    slots.extend([-1] * num_pad)
    starts.extend(range(starts[-1] + 1, starts[-1] + 1 + num_pad))
    all_lens = seq_lens + [1] * num_pad
    num_tokens = starts[-1]
    padded_tokens = max(num_tokens, pad_tokens_to or 0)
    token_pad = padded_tokens - num_tokens
    token_ids.extend([0] * token_pad)
    positions.extend([0] * token_pad)
    slots.extend([-1] * token_pad)
    if num_pad:
        decode.extend(range(num_seqs, num_rows))
        max_decode_len = max(max_decode_len, 1)
    _put(arrays, "token_ids", token_ids)
    _put(arrays, "positions", positions)
    _put(arrays, "slot_mapping", slots)
    _put(arrays, "query_start_loc", starts)
    _put(arrays, "num_rows", [num_rows])
    _put(arrays, "seq_lens", all_lens)
    _put(arrays, "seq_lens_i32", all_lens)
    _put(arrays, "decode_seq_ids", decode)
    _put(arrays, "decode_token_ids", [starts[b] for b in decode])
    _put(arrays, "prefill_seq_ids", prefill)
    _put(arrays, "sample_indices", sample_indices)
    if pad_tokens_to is not None:
        rows = sampled_rows_for(padded_tokens, layout.max_num_seqs)
        arrays["sample_indices"][len(sample_indices) : rows] = 0
    _put(arrays, "pending_positions", pending_positions)
    _put(arrays, "pending_rows", pending_rows)
    sampling = plan_sampling(
        [s.sampling.temperature for s in sampled],
        [s.sampling.top_k for s in sampled],
        [s.sampling.top_p for s in sampled],
        [s.sampling.seed for s in sampled],
        [s.output_index for s in sampled],
        vocab_size,
        [s.sampling.min_p for s in sampled],
    )
    _put(arrays, "sample_rows", sampling.rows)
    _put(arrays, "temperatures", sampling.temperatures)
    _put(arrays, "top_ks", sampling.top_ks)
    _put(arrays, "top_ps", sampling.top_ps)
    if sampling.min_ps:
        _put(arrays, "min_ps", sampling.min_ps)
    _put(arrays, "unseeded", sampling.unseeded)
    _put(arrays, "seeded", sampling.seeded)
    if sampling.seeded:
        _put(arrays, "seeded_uniforms", seeded_draws(sampling.seeds, sampling.output_indices))
    return StagedStep(
        num_seqs=num_seqs,
        num_rows=num_rows,
        num_tokens=num_tokens,
        query_lens=query_lens + [1] * num_pad,
        seq_lens=all_lens,
        num_decodes=len(decode),
        num_prefills=len(prefill),
        max_decode_len=max_decode_len,
        max_prefill_query_len=max_prefill_len,
        sampled_req_ids=[s.req_id for s in sampled],
        sampling=sampling,
        num_pending=len(pending_positions),
        padded_tokens=padded_tokens,
    )


def sampled_rows_for(num_tokens: int, max_num_seqs: int) -> int:
    """The sampled rows a step padded to ``num_tokens`` tokens stages: at
    most one a sequence, and a sequence has a token."""
    return min(num_tokens, max_num_seqs)


def resolve_pending_tokens(
    views: Mapping[str, torch.Tensor], previous: torch.Tensor, num: int
) -> None:
    """Puts the previous step's sampled ids (``previous``, on the device) into
    the staged ``token_ids`` at the step's ``num`` pending tokens, in place,
    without a host round trip: two launches over the staged positions and rows
    (``views``: a staging buffer's). No-op when the step has none."""
    if num == 0:
        return
    rows = previous.index_select(0, views["pending_rows"][:num])
    views["token_ids"].index_copy_(0, views["pending_positions"][:num], rows)


def _pending_row(previous_rows: Mapping[str, int] | None, req_id: str) -> int:
    if previous_rows is None or req_id not in previous_rows:
        raise ValueError(f"{req_id}: a pending token, but the previous step sampled none for it")
    return previous_rows[req_id]


def stage_padding(buffers: StagingBuffers, num_rows: int) -> StagedStep:
    """A decode-only step of padding rows alone: what a CUDA graph is captured on."""
    return stage_step(StepPlan(step=-1), buffers, 1, 1, pad_to=num_rows)


def _put(arrays: dict[str, np.ndarray], name: str, values: list[int] | list[float]) -> None:
    arrays[name][: len(values)] = values


def _refuse_blocks(req_id: str, num_blocks: int, max_blocks: int) -> NoReturn:
    if num_blocks > max_blocks:
        raise ValueError(
            f"request {req_id} holds {num_blocks} blocks; "
            f"at most {max_blocks} per sequence are staged"
        )
    raise ValueError(f"request {req_id}: its blocks cannot hold its tokens")
