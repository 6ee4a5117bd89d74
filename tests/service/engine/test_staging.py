"""The staging layout, the step builder and the CUDA-graph buckets: device-independent."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from slipstream.kernels.attention import build_attention_metadata
from slipstream.kernels.sampling import seeded_uniform
from slipstream.scheduler.plan import PENDING_TOKEN, ScheduledSeq, StepPlan
from slipstream.scheduler.request import SamplingParams
from slipstream.service.engine.cuda_graphs import (
    GraphStats,
    bucket_for,
    graph_batch_sizes,
    is_out_of_memory,
)
from slipstream.service.engine.staged_attention import staged_metadata
from slipstream.service.engine.staging import (
    StagingBuffers,
    StagingLayout,
    resolve_pending_tokens,
    stage_padding,
    stage_step,
)

BLOCK = 4


def _seq(req_id, tokens, start, blocks, sample=True, sampling=None):
    return ScheduledSeq(req_id, tokens, start, blocks, sample, 0, sampling or SamplingParams())


def _buffers(tokens=64, seqs=8, blocks=6) -> StagingBuffers:
    return StagingBuffers(StagingLayout.build(tokens, seqs, blocks), torch.device("cpu"), False)


def test_layout_regions_are_aligned_disjoint_and_table_last():
    layout = StagingLayout.build(100, 7, 5)
    spans = sorted(
        (r.offset, r.offset + -(-r.numel * r.dtype.itemsize // 8)) for r in layout.regions.values()
    )
    for (_, end), (start, _) in itertools.pairwise(spans):
        assert end <= start
    assert all(r.offset % 8 == 0 for r in layout.regions.values())
    table = layout.regions["block_tables"]
    assert table.offset == spans[-1][0]
    assert layout.end(3) == table.offset + 3 * 5 <= layout.total_words


def test_views_share_the_buffer_with_their_dtypes():
    buffers = _buffers()
    views = buffers.host_views
    assert views["seq_lens_i32"].dtype == torch.int32
    assert views["temperatures"].dtype == torch.float32
    assert views["block_tables"].shape == (8, 6)
    views["temperatures"][0] = 0.5
    assert buffers.host_arrays["temperatures"][0] == 0.5


def test_upload_copies_the_prefix_the_rows_use():
    buffers = _buffers()
    buffers.host_arrays["block_tables"][:] = 7
    buffers.upload(2)
    table = buffers.device_views["block_tables"]
    assert (table[:2] == 7).all() and (table[2:] == 0).all()


def test_pending_tokens_are_put_in_from_the_previous_steps_ids():
    """A plan made ahead of its predecessor's results: each pending token is
    staged as token 0 with its place, and the previous step's sampled ids go
    in on the device, every other token left as staged."""
    plan = StepPlan(
        step=2,
        seqs=[
            _seq("a", [PENDING_TOKEN], 6, [3, 1]),
            _seq("b", [9, 8, 7], 2, [0, 4]),  # a prefill chunk between them
            _seq("c", [PENDING_TOKEN], 3, [2]),
            _seq("d", [21], 1, [5]),  # a decode whose token the host knows
        ],
    )
    buffers = _buffers()
    step = stage_step(plan, buffers, BLOCK, 100, previous_rows={"c": 0, "a": 2, "x": 1})
    assert step.num_pending == 2
    assert buffers.host_views["token_ids"][:6].tolist() == [0, 9, 8, 7, 0, 21]
    buffers.upload(step.num_rows)
    views = buffers.device_views
    previous = torch.tensor([40, 41, 42])
    resolve_pending_tokens(views, previous, step.num_pending)
    assert views["token_ids"][:6].tolist() == [42, 9, 8, 7, 40, 21]
    resolve_pending_tokens(views, previous, 0)  # none: nothing moves
    assert views["token_ids"][:6].tolist() == [42, 9, 8, 7, 40, 21]
    with pytest.raises(ValueError, match="previous step sampled none"):
        stage_step(plan, buffers, BLOCK, 100, previous_rows={"a": 0})


def _mixed_plan() -> StepPlan:
    return StepPlan(
        step=1,
        seqs=[
            _seq("a", [5], 6, [3, 1]),  # decode at position 6
            _seq("b", [9, 8, 7], 2, [0, 4], sample=False),  # prefill chunk 2..4
            _seq("c", [11, 12], 0, [2], sampling=SamplingParams(0.7, 5, 0.9, 3)),
        ],
    )


def test_stage_step_matches_the_reference_metadata():
    buffers = _buffers()
    plan = _mixed_plan()
    step = stage_step(plan, buffers, BLOCK, vocab_size=100)
    buffers.upload(step.num_rows)
    views = buffers.device_views
    ref = build_attention_metadata([1, 3, 2], [7, 5, 2], [[3, 1], [0, 4], [2]], BLOCK,
                                   torch.device("cpu"), torch.float32)  # fmt: skip
    meta = staged_metadata(step, views, BLOCK)
    assert meta.query_lens == ref.query_lens and meta.seq_lens == ref.seq_lens
    assert torch.equal(meta.slot_mapping, ref.slot_mapping)
    assert torch.equal(meta.query_start_loc, ref.query_start_loc)
    assert torch.equal(meta.seq_lens_t, ref.seq_lens_t)
    assert torch.equal(meta.block_tables[:, :2], ref.block_tables)
    assert views["token_ids"][:6].tolist() == [5, 9, 8, 7, 11, 12]
    assert views["positions"][:6].tolist() == [6, 2, 3, 4, 0, 1]
    triton = meta.triton
    assert triton.seq_lens.dtype == torch.int32 and triton.seq_lens.tolist() == [7, 5, 2]
    assert triton.decode_seq_ids.tolist() == [0] and triton.decode_token_ids.tolist() == [0]
    assert triton.prefill_seq_ids.tolist() == [1, 2]
    assert (triton.max_decode_len, triton.max_prefill_query_len) == (7, 3)
    assert step.sampled_req_ids == ["a", "c"]
    assert views["sample_indices"][:2].tolist() == [0, 5]
    assert step.sampling.rows == [1]
    assert views["sample_rows"][:1].tolist() == [1]
    assert views["temperatures"][:1].tolist() == pytest.approx([0.7])
    assert views["top_ks"][:1].tolist() == [5]
    assert views["top_ps"][:1].tolist() == pytest.approx([0.9])
    assert views["seeded"][:1].tolist() == [0]
    # the seeded row's draw, as the CPU sampler makes it (seed 3, output index 0)
    assert views["seeded_uniforms"].dtype == torch.float64
    assert views["seeded_uniforms"][:1].tolist() == [seeded_uniform(3, 0)]


def test_padded_decode_step():
    buffers = _buffers()
    plan = StepPlan(step=2, seqs=[_seq("a", [5], 6, [3, 1]), _seq("b", [6], 0, [2])])
    step = stage_step(plan, buffers, BLOCK, vocab_size=100, pad_to=4)
    buffers.upload(step.num_rows)
    views = buffers.device_views
    assert (step.num_seqs, step.num_rows, step.num_tokens) == (2, 4, 4)
    assert views["slot_mapping"][:4].tolist() == [1 * BLOCK + 2, 2 * BLOCK, -1, -1]
    assert views["seq_lens_i32"][:4].tolist() == [7, 1, 1, 1]
    assert views["query_start_loc"][:5].tolist() == [0, 1, 2, 3, 4]
    assert views["num_rows"].tolist() == [4]
    assert views["decode_seq_ids"][:4].tolist() == [0, 1, 2, 3]
    assert views["block_tables"][2:4, 0].tolist() == [0, 0]
    assert step.sampled_req_ids == ["a", "b"] and step.num_prefills == 0


def test_block_tables_hold_every_rows_blocks_across_changing_steps():
    """Rows keep what the same buffer wrote two steps back and get only new
    blocks; a row that changed hands, lost blocks, was padded or had a block
    replaced is written whole. Every staged row must hold exactly its table."""
    rng = random.Random(0)
    buffers = _buffers(tokens=64, seqs=8, blocks=6)
    tables = {f"r{i}": [rng.randrange(50)] for i in range(12)}
    for step in range(400):
        for req_id, blocks in tables.items():
            move = rng.random()
            if move < 0.3 and len(blocks) < 6:
                blocks.append(rng.randrange(50))  # a decode crossed into a new block
            elif move < 0.35:
                tables[req_id] = [rng.randrange(50) for _ in range(rng.randint(1, 6))]  # requeued
            elif move < 0.4:
                blocks[rng.randrange(len(blocks))] = rng.randrange(50)  # copy-on-write
        ids = rng.sample(sorted(tables), rng.randint(0, 6))
        if step % 7 == 0:
            ids.sort()  # the same rows as a recent step
        seqs = [_seq(i, [1], 0, list(tables[i])) for i in ids]
        staged = stage_step(StepPlan(step=step, seqs=seqs), buffers, BLOCK, 100, pad_to=8)
        buffers.upload(staged.num_rows)
        table = buffers.device_views["block_tables"]
        for row, seq in enumerate(seqs):
            assert table[row, : len(seq.block_ids)].tolist() == seq.block_ids, (step, row)
        assert table[len(seqs) : 8, 0].tolist() == [0] * (8 - len(seqs))


def test_a_step_padded_by_tokens():
    """Padding tokens (a step run at a layer-graph bucket) follow the plan's
    tokens and belong to no row: token 0 at position 0, slot -1, rows and
    their metadata as without padding."""
    buffers = _buffers()
    plain = stage_step(_mixed_plan(), buffers, BLOCK, 100)
    plain_views = {k: v.clone() for k, v in buffers.host_views.items()}
    step = stage_step(_mixed_plan(), buffers, BLOCK, 100, pad_tokens_to=16)
    views = buffers.host_views
    assert (step.num_rows, step.num_tokens, step.padded_tokens) == (3, 6, 16)
    assert plain.padded_tokens == 6
    assert views["token_ids"][:16].tolist() == [5, 9, 8, 7, 11, 12] + [0] * 10
    assert views["positions"][6:16].tolist() == [0] * 10
    slots = plain_views["slot_mapping"][:6].tolist()
    assert views["slot_mapping"][:16].tolist() == slots + [-1] * 10
    for name in ("query_start_loc", "seq_lens", "decode_seq_ids", "prefill_seq_ids"):
        assert views[name][:4].tolist() == plain_views[name][:4].tolist(), name
    assert views["num_rows"].tolist() == [3]  # the sequences: padding tokens own no row
    assert (step.num_decodes, step.num_prefills, step.sampled_req_ids) == (1, 2, ["a", "c"])
    # A whole-step graph gathers min(16 tokens, 8 seqs) rows: the sampled
    # ones, then token 0, over whatever an earlier step left there.
    sampled = plain_views["sample_indices"][:2].tolist()
    assert views["sample_indices"][:8].tolist() == sampled + [0] * 6
    views["sample_indices"].fill_(99)
    stage_step(_mixed_plan(), buffers, BLOCK, 100, pad_tokens_to=16)
    assert views["sample_indices"][:8].tolist() == sampled + [0] * 6
    with pytest.raises(ValueError, match="tokens exceed"):
        stage_step(_mixed_plan(), buffers, BLOCK, 100, pad_tokens_to=65)
    decode = StepPlan(step=2, seqs=[_seq("a", [5], 6, [3, 1])])
    with pytest.raises(ValueError, match="not both"):
        stage_step(decode, buffers, BLOCK, 100, pad_to=2, pad_tokens_to=16)


def test_padding_a_prefill_is_refused():
    with pytest.raises(ValueError, match="decode-only"):
        stage_step(_mixed_plan(), _buffers(), BLOCK, 100, pad_to=4)


def test_capacity_checks():
    with pytest.raises(ValueError, match="staged rows"):
        stage_step(_mixed_plan(), _buffers(seqs=2), BLOCK, 100)
    with pytest.raises(ValueError, match="tokens exceed"):
        stage_step(_mixed_plan(), _buffers(tokens=4), BLOCK, 100)
    with pytest.raises(ValueError, match="per sequence are staged"):
        stage_step(_mixed_plan(), _buffers(blocks=1), BLOCK, 100)


def test_stage_padding_only():
    buffers = _buffers()
    step = stage_padding(buffers, 8)
    assert (step.num_seqs, step.num_rows, step.sampled_req_ids) == (0, 8, [])
    assert buffers.host_views["slot_mapping"][:8].tolist() == [-1] * 8


def test_graph_batch_sizes():
    assert graph_batch_sizes(1) == [1]
    assert graph_batch_sizes(10) == [1, 2, 4, 8, 10]
    assert graph_batch_sizes(32) == [1, 2, 4, 8, 16, 24, 32]
    assert graph_batch_sizes(37) == [1, 2, 4, 8, 16, 24, 32, 37]
    sizes = graph_batch_sizes(256)
    assert sizes[:5] == [1, 2, 4, 8, 16] and sizes[-1] == 256 and len(sizes) == 35
    with pytest.raises(ValueError):
        graph_batch_sizes(0)


@pytest.mark.parametrize(("n", "bucket"), [(0, None), (1, 1), (3, 4), (8, 8), (9, 16), (17, 24),
                                           (32, 32), (33, None)])  # fmt: skip
def test_bucket_for(n, bucket):
    assert bucket_for(n, graph_batch_sizes(32)) == bucket


def test_out_of_memory_is_recognised_through_a_failed_capture():
    try:
        try:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2 GiB")
        except torch.OutOfMemoryError:
            raise RuntimeError("operation not permitted when stream is capturing") from None
    except RuntimeError as exc:
        assert is_out_of_memory(exc)
    assert not is_out_of_memory(RuntimeError("shape mismatch"))


def test_the_start_up_line_of_captured_graphs():
    """What the start-up log says of each kind of graph (``cuda_graphs``)."""
    stats = GraphStats(True, [16, 32, 64], capture_seconds=0.227, memory_bytes=107 << 20)
    assert stats.log_line("token counts") == "3 token counts 16..64 captured in 0.23 s, 107 MiB"
    off = GraphStats(False, disabled_reason="capture failed: OutOfMemoryError")
    assert off.log_line("batch sizes") == "off (capture failed: OutOfMemoryError)"
    assert GraphStats(False).log_line("batch sizes") == "off (disabled)"
