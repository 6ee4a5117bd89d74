"""The fused CPU paged-attention kernel (``slipstream.kernels.cpu_attention``)
against dense attention over the unpaged sequences and against the torch path.

The extension is built once into ``$SLIPSTREAM_HOME/cache/extensions`` (the
test home); a machine without a C++ compiler skips the kernel's tests, any
other build failure fails them.
"""

from __future__ import annotations

import logging
import os
import shutil
import warnings
from pathlib import Path
from unittest import mock

import pytest
import torch
from paged_fixtures import PagedBatch, dense_attention, make_paged_batch, quantized

from slipstream.kernels import attention, backend, cpu_attention, cpu_features, extensions
from slipstream.kernels.attention import AttentionMetadata, build_attention_metadata
from slipstream.kernels.block_copy import copy_blocks
from slipstream.kernels.kv_layout import allocate_kv_cache, head_major
from slipstream.kernels.kv_write import write_kv
from slipstream.kernels.workspace import Workspace

CPU = torch.device("cpu")
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
GQA = [(8, 8), (8, 4), (9, 3), (8, 2)]  # (num_heads, num_kv_heads): groups 1, 2, 3, 4

# (query_lens, seq_lens) per batch kind; contexts from 1 to 2000 tokens.
DECODES = ([1] * 10, [1, 2, 15, 16, 17, 33, 64, 300, 777, 2000])
PREFILLS = ([5, 64, 1], [5, 64, 1])  # from position 0: plain causal
PREFIX_PREFILLS = ([7, 40, 3], [50, 140, 1203])  # chunks over a cached prefix
MIXED = ([1, 7, 1, 1, 20, 1, 33, 1], [1, 7, 45, 17, 52, 100, 33, 1500])
BATCHES = {"decode": DECODES, "prefill": PREFILLS, "prefix": PREFIX_PREFILLS, "mixed": MIXED}


@pytest.fixture(scope="module")
def home() -> Path:
    return Path(os.environ["SLIPSTREAM_HOME"])  # set for the session by tests/conftest.py


@pytest.fixture(scope="module")
def fused(home: Path) -> None:
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        pytest.skip("no C++ compiler: the fused CPU kernel cannot be built here")
    if not cpu_attention.is_available(home):
        pytest.fail(f"the fused CPU kernel did not build: {cpu_attention.failure()}")


def _loaded_bf16_prefill() -> str:
    """The bf16 prefill mode loading the kernel sets on this CPU's answer (put back in force)."""
    return cpu_attention.set_cpu_bf16_prefill()


def _set_bf16_prefill_or_skip(mode: str) -> None:
    """Puts ``mode`` in force; skips where it is refused (brgemm: no oneDNN bf16 brgemm here)."""
    try:
        assert cpu_attention.set_bf16_prefill(mode) == mode
    except RuntimeError as error:
        if "does not run here" not in str(error):
            raise
        pytest.skip(f"bf16 prefill {mode} is refused on this CPU ({error})")


def _meta(batch: PagedBatch) -> AttentionMetadata:
    return build_attention_metadata(
        batch.query_lens, batch.seq_lens, batch.block_tables, batch.block_size, CPU,
        batch.k_cache.dtype, workspace=Workspace(CPU),
    )  # fmt: skip


def _case(
    lens: tuple[list[int], list[int]],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    seed: int = 0,
) -> tuple[torch.Tensor, PagedBatch, AttentionMetadata]:
    generator = torch.Generator().manual_seed(seed)
    query_lens, seq_lens = lens
    batch = make_paged_batch(
        query_lens, seq_lens, block_size, num_kv_heads, head_dim, dtype, generator,
        head_major=True,
    )  # fmt: skip
    q = torch.randn((sum(query_lens), num_heads, head_dim), generator=generator).to(dtype)
    return q, batch, _meta(batch)


def _assert_matches_dense(out: torch.Tensor, q: torch.Tensor, batch: PagedBatch, scale: float):  # type: ignore[no-untyped-def]
    assert out.shape == q.shape and out.dtype == q.dtype
    tol = TOLERANCE[q.dtype]
    torch.testing.assert_close(out.double(), dense_attention(q, batch, scale), atol=tol, rtol=tol)


@pytest.mark.usefixtures("fused")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("head_dim", [64, 32])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), GQA, ids=lambda n: str(n))
@pytest.mark.parametrize("kind", list(BATCHES))
def test_matches_dense_attention(
    kind: str, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> None:
    block_size = 32 if head_dim == 64 else 16
    q, batch, meta = _case(BATCHES[kind], num_heads, num_kv_heads, head_dim, block_size, dtype)
    scale = head_dim**-0.5
    out = cpu_attention.paged_attention(q, batch.k_cache, batch.v_cache, meta, scale)
    _assert_matches_dense(out, q, batch, scale)


@pytest.mark.usefixtures("fused")
@pytest.mark.parametrize("kind", ["decode", "prefix", "mixed"])
def test_two_threads_split_long_contexts(kind: str) -> None:
    """With 2 threads the long rows are cut over keys and merged (see the plan test)."""
    q, batch, meta = _case(BATCHES[kind], 8, 2, 64, 32, torch.float32, seed=1)
    torch.set_num_threads(2)  # the autouse fixture restores 1
    out = cpu_attention.paged_attention(q, batch.k_cache, batch.v_cache, meta, 0.125)
    _assert_matches_dense(out, q, batch, 0.125)


@pytest.mark.usefixtures("fused")
@pytest.mark.parametrize(
    ("kv_dtype", "bf16_prefill"),
    [
        (torch.float32, "tiles"),
        (torch.bfloat16, "tiles"),
        (torch.bfloat16, "dot"),
        (torch.bfloat16, "dot-tiles"),
        (torch.bfloat16, "brgemm"),
    ],
    ids=["fp32", "bf16", "bf16-dot-rows", "bf16-dot-tiles", "bf16-brgemm"],
)
def test_two_threads_split_a_long_prefill_chunk(kv_dtype: torch.dtype, bf16_prefill: str) -> None:
    """A chunk at the end of a long prefix: its tasks (64 rows, the tiled path)
    are cut over keys, their partial records merged (bf16 prefill as the
    AVX512-BF16 variant's dot product rows, vdpbf16ps tiles and brgemm tiles
    too, where that variant runs)."""
    _set_bf16_prefill_or_skip(bf16_prefill)
    try:
        _split_long_prefill_chunk(kv_dtype)
    finally:
        cpu_attention.set_bf16_prefill(_loaded_bf16_prefill())


def _split_long_prefill_chunk(kv_dtype: torch.dtype) -> None:
    lens = ([64, 1], [2000, 300])
    starts = torch.tensor([0, 64, 65])
    assert torch.ops.slipstream.paged_attention_plan(
        torch.tensor(lens[1]), starts, 2, 4, 64, 32, 2
    )[1] > 0  # fmt: skip
    q, batch, meta = _case(lens, 8, 2, 64, 32, kv_dtype, seed=3)
    torch.set_num_threads(2)  # the autouse fixture restores 1
    out = cpu_attention.paged_attention(q, batch.k_cache, batch.v_cache, meta, 0.125)
    _assert_matches_dense(out, q, batch, 0.125)


@pytest.mark.usefixtures("fused")
def test_plan_splits_one_long_decode_but_not_a_big_batch() -> None:
    plan = torch.ops.slipstream.paged_attention_plan

    def summary(seq_lens: list[int], threads: int) -> list[int]:
        starts = torch.arange(len(seq_lens) + 1, dtype=torch.int64)
        return plan(torch.tensor(seq_lens), starts, 4, 2, 64, 32, threads)

    tasks, merges = summary([2000], 2)
    assert merges == 4 and tasks >= 4 * 2  # every kv head cut, both threads kept busy
    assert summary([2000], 1) == [4, 0]  # one thread: splitting only costs
    assert summary([300] * 256, 2) == [256 * 4, 0]  # enough whole tasks already


@pytest.mark.usefixtures("fused")
@pytest.mark.parametrize("head_dim", [128, 20])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_other_head_dims_and_a_block_size_not_a_multiple_of_8(
    head_dim: int, dtype: torch.dtype
) -> None:
    q, batch, meta = _case(MIXED, 6, 2, head_dim, 5, dtype, seed=2)
    out = cpu_attention.paged_attention(q, batch.k_cache, batch.v_cache, meta, 0.3)
    _assert_matches_dense(out, q, batch, 0.3)


def run_variant(isa: str, q: torch.Tensor, batch: PagedBatch, meta: AttentionMetadata,
                scale: float) -> torch.Tensor:  # fmt: skip
    """The op with its variant named; skips where this CPU cannot run it."""
    try:
        return torch.ops.slipstream.paged_attention(
            q, head_major(batch.k_cache), head_major(batch.v_cache), meta.block_tables,
            meta.seq_lens_t, meta.query_start_loc, scale, isa,
        )  # fmt: skip
    except RuntimeError as error:
        if "cannot run" not in str(error):
            raise
        pytest.skip(f"this CPU cannot run the {isa} variant ({error})")


def test_bf16_prefill_mode_is_picked_per_cpu() -> None:
    """The brgemm tiles where AMX-BF16 is (their products on AMX tiles), the
    vdpbf16ps tiles on other AVX512-BF16 CPUs (measured fastest on a Zen 5)."""

    def cpu(*flags: str) -> cpu_features.CpuFeatures:
        return cpu_features.CpuFeatures("Some CPU", flags, "AVX512", can_pack_bf16=True)

    assert cpu_attention.bf16_prefill_for(cpu("amx_bf16", "avx512_bf16", "avx512f")) == "brgemm"
    assert cpu_attention.bf16_prefill_for(cpu("avx512_bf16", "avx512f", "avx2")) == "dot-tiles"
    assert cpu_attention.bf16_prefill_for(cpu("avx2")) == "dot"


@pytest.mark.usefixtures("fused")
def test_loading_the_kernel_sets_the_cpus_bf16_prefill_mode() -> None:
    """The load hook puts this CPU's mode in force, whatever was set before:
    the AVX512-BF16 variant's bf16 prefill output is that mode's (the three
    modes' outputs differ at head_dim 64)."""
    q, batch, meta = _case(MIXED, 8, 2, 64, 16, torch.bfloat16, seed=3)
    mode = _loaded_bf16_prefill()
    other = "tiles" if mode == "dot" else "dot"
    out = {}
    try:
        for each in (other, mode):
            cpu_attention.set_bf16_prefill(each)
            out[each] = run_variant("avx512", q, batch, meta, 0.1)
        cpu_attention.set_bf16_prefill(other)
        cpu_attention._after_load()
        loaded = run_variant("avx512", q, batch, meta, 0.1)
    finally:
        cpu_attention.set_bf16_prefill(mode)
    assert not torch.equal(out[other], out[mode])
    assert torch.equal(loaded, out[mode])


@pytest.mark.usefixtures("fused")
@pytest.mark.parametrize("isa", ["portable", "avx2", "avx512"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("head_dim", [72, 64, 160])
def test_each_instruction_set_variant(isa: str, dtype: torch.dtype, head_dim: int) -> None:
    """Every variant against float64 attention. Under avx512, bf16 K/V with
    head_dim a multiple of 32 take the vdpbf16ps rows (64: two chunks, 160:
    the 128-column loop and a tail), 72 the 16-lane float rows; fp32 K/V run
    the AVX2 code there (the C++ file says why)."""
    q, batch, meta = _case(MIXED, 8, 2, head_dim, 16, dtype, seed=3)
    out = run_variant(isa, q, batch, meta, 0.1)
    _assert_matches_dense(out, q, batch, 0.1)


@pytest.mark.usefixtures("fused")
@pytest.mark.parametrize(("head_dim", "block_size"), [(64, 16), (96, 8), (18, 24), (80, 16)])
def test_bf16_prefill_modes_of_the_avx512_variant(head_dim: int, block_size: int) -> None:
    """set_bf16_prefill: bf16 prefill chunks of the AVX512-BF16 variant take
    the dot product rows, the fp32 tiles or the vdpbf16ps
    tiles; decodes keep the rows. Each against float64; the vdpbf16ps tiles
    unlike the fp32 ones (p is rounded to bf16 there), and where the rows
    serve (head_dim a multiple of 32), the rows unlike the fp32 tiles: the
    switch reaches the kernel. Blocks of 8 and 24 keys leave odd and partial
    tiles; at head_dim 18 the rows give way to the tiles in every mode, and
    at 80 V's pairs are interleaved 32 columns at a time, then one by one."""
    q, batch, meta = _case(MIXED, 8, 2, head_dim, block_size, torch.bfloat16, seed=7)
    out = {}
    try:
        for mode in ("dot", "tiles", "dot-tiles"):
            assert cpu_attention.set_bf16_prefill(mode) == mode
            out[mode] = run_variant("avx512", q, batch, meta, 0.1)
    finally:
        loaded = _loaded_bf16_prefill()
        assert cpu_attention.set_bf16_prefill(loaded) == loaded
    for got in out.values():
        _assert_matches_dense(got, q, batch, 0.1)
    assert not torch.equal(out["dot-tiles"], out["tiles"])
    assert torch.equal(out["dot"], out["tiles"]) == (head_dim % 32 != 0)
    starts = meta.query_start_loc.tolist()
    for i in (i for i, n in enumerate(MIXED[0]) if n == 1):  # decodes: rows in every mode
        assert torch.equal(out["tiles"][starts[i]], out["dot"][starts[i]])
        assert torch.equal(out["dot-tiles"][starts[i]], out["dot"][starts[i]])
    with pytest.raises(RuntimeError, match="dot, tiles, dot-tiles or brgemm"):
        cpu_attention.set_bf16_prefill("rows")


@pytest.mark.usefixtures("fused")
@pytest.mark.parametrize("kind", ["prefill", "prefix", "mixed"])
@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim", "block_size"),
    [(8, 2, 64, 16), (9, 3, 64, 32), (14, 2, 64, 32), (8, 4, 128, 32), (8, 2, 48, 16),
     (8, 2, 80, 8), (8, 2, 18, 24), (8, 2, 64, 5)],
    ids=lambda v: str(v),
)  # fmt: skip
def test_bf16_prefill_on_brgemm(
    kind: str, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int
) -> None:
    """The brgemm tiles (oneDNN's products; AMX tiles where the CPU has them)
    against float64, where oneDNN's bf16 brgemm runs: tasks of 16 to 64 rows
    (groups of 4, 3 and 7: rows padded to 16, 48 and 64), head dims of one to
    eight 16-column blocks, V's columns interleaved 32 at a time and then
    not (48, 80); blocks of 8 and 16 keys leave partial tiles. Unlike the
    fp32 tiles (p rounded to bf16), so the mode reaches the kernel; head_dim
    18 and blocks of 5 keys (not readable in 8-row steps) take the vdpbf16ps
    tiles' or rows' way, as under dot-tiles."""
    lens = BATCHES[kind]
    q, batch, meta = _case(lens, num_heads, num_kv_heads, head_dim, block_size, torch.bfloat16)
    out = {}
    try:
        for mode in ("tiles", "dot-tiles", "brgemm"):
            _set_bf16_prefill_or_skip(mode)
            out[mode] = run_variant("avx512", q, batch, meta, 0.1)
    finally:
        _loaded_bf16_prefill()
    _assert_matches_dense(out["brgemm"], q, batch, 0.1)
    if head_dim % 16 or block_size % 8:
        assert torch.equal(out["brgemm"], out["dot-tiles"])
    else:
        assert not torch.equal(out["brgemm"], out["tiles"])


@pytest.mark.usefixtures("fused")
def test_brgemm_gives_way_when_onednn_is_switched_off(capfd: pytest.CaptureFixture[str]) -> None:
    """oneDNN switched off after brgemm was put in force: its first call
    throws inside the task loop; each such task is redone on the vdpbf16ps
    tiles (the same output), the op warns with the reason and the mode falls
    back to those tiles. Putting brgemm in force again is refused, saying
    why; the loader then keeps the fp32 tiles."""
    q, batch, meta = _case(PREFIX_PREFILLS, 8, 2, 64, 16, torch.bfloat16, seed=4)
    torch.set_num_threads(2)  # the autouse fixture restores 1: both threads catch
    try:
        _set_bf16_prefill_or_skip("dot-tiles")
        dot_tiles = run_variant("avx512", q, batch, meta, 0.1)
        _set_bf16_prefill_or_skip("tiles")
        tiles = run_variant("avx512", q, batch, meta, 0.1)
        _set_bf16_prefill_or_skip("brgemm")
        with torch.backends.mkldnn.flags(enabled=False):
            for call in range(2):
                capfd.readouterr()
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    assert torch.equal(run_variant("avx512", q, batch, meta, 0.1), dot_tiles)
                said = capfd.readouterr().err + "".join(str(w.message) for w in caught)
                # c10's warning: on stderr, or a Python warning where the call path converts it
                fell_back = "brgemm failed" in said and "vdpbf16ps tiles from now on" in said
                assert fell_back == (call == 0), said  # once: the mode has fallen back
            with pytest.raises(RuntimeError, match="does not run here: oneDNN is disabled"):
                cpu_attention.set_bf16_prefill("brgemm")
            with mock.patch.object(cpu_attention, "bf16_prefill_for", return_value="brgemm"):
                assert cpu_attention.set_cpu_bf16_prefill() == "tiles"
            assert torch.equal(run_variant("avx512", q, batch, meta, 0.1), tiles)
    finally:
        _loaded_bf16_prefill()
    _assert_matches_dense(dot_tiles, q, batch, 0.1)


@pytest.mark.usefixtures("fused")
@pytest.mark.parametrize("isa", ["portable", "avx2", "avx512"])
@pytest.mark.parametrize("head_dim", [32, 96, 256])
@pytest.mark.parametrize("block_size", [8, 24, 32])
def test_bf16_groups_whose_rows_fill_several_register_chunks(
    isa: str, head_dim: int, block_size: int
) -> None:
    """Under avx512 the p . V pass keeps up to 12 accumulators in registers:
    6 rows at head_dim 32, 2 at 96, 1 per 128 columns at 256. A group of 7
    query heads leaves a remainder chunk at each width, and the prefill rows
    (7 per token) some that see none of a tile (causal). Blocks of 8 and 24
    keys leave the second 16 keys of a tile's scores partly or wholly unread."""
    q, batch, meta = _case(MIXED, 14, 2, head_dim, block_size, torch.bfloat16, seed=5)
    out = run_variant(isa, q, batch, meta, 0.15)
    _assert_matches_dense(out, q, batch, 0.15)


@pytest.mark.usefixtures("fused")
@pytest.mark.parametrize("int8", [False, True], ids=["model-dtype", "int8"])
def test_agrees_with_the_torch_path_after_write_kv(int8: bool) -> None:
    """A layer as the model runs it: write this step's K/V, then attend, through
    each backend; into an int8 cache, the write quantizes and both read the rows."""
    generator = torch.Generator().manual_seed(4)
    query_lens, seq_lens = MIXED
    batch = make_paged_batch(
        query_lens, seq_lens, 16, 2, 64, torch.float32, generator, head_major=True
    )
    if int8:
        batch = quantized(batch)
    meta = _meta(batch)
    new_k = torch.cat([k[-n:] for k, n in zip(batch.keys, query_lens, strict=True)]).float()
    new_v = torch.cat([v[-n:] for v, n in zip(batch.values, query_lens, strict=True)]).float()
    q = torch.randn(sum(query_lens), 8, 64, generator=generator)
    outputs = []
    for name in ("torch", "cpu"):
        k_cache, v_cache = batch.k_cache.clone(), batch.v_cache.clone()
        k_cache.view(-1, 2, k_cache.shape[-1])[meta.slot_mapping] = 0  # stale until written
        backend.write_kv_for(name)(k_cache, v_cache, new_k, new_v, meta)
        outputs.append(backend.paged_attention_for(name)(q, k_cache, v_cache, meta, 0.125))
    torch.testing.assert_close(outputs[1], outputs[0], atol=1e-5, rtol=1e-5)
    _assert_matches_dense(outputs[1], q, batch, 0.125)


@pytest.mark.usefixtures("fused")
@pytest.mark.parametrize("isa", ["portable", "avx2", "avx512"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("kind", list(BATCHES))
@pytest.mark.parametrize(
    ("head_dim", "block_size"), [(64, 32), (72, 16), (20, 12), (128, 12), (256, 16)]
)
def test_int8_rows_match_attention_over_the_values_they_hold(
    head_dim: int, block_size: int, kind: str, dtype: torch.dtype, isa: str
) -> None:
    """Int8 K/V rows (values, then the row's scale) under every variant, with
    fp32 and bf16 queries, against float64 attention over the dequantized
    rows: the kernel adds no error of its own to the quantization's. Head
    dims 72 and 20 leave a tail past the 8-lane loop; blocks of 12 keys a
    tile that is not a multiple of 8 rows. Under AVX512-BF16 the decodes of
    a bf16 q with head_dim 64, 128 and 256 take the int8 tiles as bf16
    integers on vdpbf16ps."""
    q, batch, _ = _case(BATCHES[kind], 9, 3, head_dim, block_size, torch.float32, seed=7)
    batch = quantized(batch)
    q = q.to(dtype)
    out = run_variant(isa, q, batch, _meta(batch), head_dim**-0.5)
    _assert_matches_dense(out, q, batch, head_dim**-0.5)


@pytest.mark.usefixtures("fused")
@pytest.mark.parametrize("mode", ["dot", "tiles", "dot-tiles", "brgemm"])
def test_int8_prefill_under_each_bf16_prefill_mode(mode: str) -> None:
    """Int8 K/V prefill chunks of a bf16 q in the AVX-512 variant, whichever
    way bf16 prefill runs there (the CPU's own choice is one of them): on
    the vdpbf16ps tiles with the rows' scales under ``dot-tiles``, widened
    into fp32 tiles otherwise; each against float64 over the dequantized rows."""
    q, batch, _ = _case(MIXED, 9, 3, 64, 16, torch.float32, seed=11)
    batch = quantized(batch)
    q = q.to(torch.bfloat16)
    try:
        _set_bf16_prefill_or_skip(mode)
        out = run_variant("avx512", q, batch, _meta(batch), 0.125)
    finally:
        loaded = _loaded_bf16_prefill()
        assert cpu_attention.set_bf16_prefill(loaded) == loaded
    _assert_matches_dense(out, q, batch, 0.125)


@pytest.mark.usefixtures("fused")
@pytest.mark.parametrize(
    ("dtype", "kv_dtype"),
    [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
     (torch.float32, torch.int8), (torch.bfloat16, torch.int8)],
    ids=["fp32", "bf16", "fp32-int8", "bf16-int8"],
)  # fmt: skip
@pytest.mark.parametrize("isa", ["portable", "avx2"])
def test_native_write_stores_the_bytes_of_the_torch_writer(
    dtype: torch.dtype, kv_dtype: torch.dtype, isa: str
) -> None:
    """k and v as the model hands them over (views of one fused projection,
    a token stride), one of them all zeros (an int8 row's scale then has a
    floor); the vector rows and the baseline's scalar ones (AVX-512 CPUs
    write with the AVX2 code)."""
    picked = torch.ops.slipstream.paged_attention_set_max_isa(isa)
    try:
        if picked != isa:
            pytest.skip(f"this CPU cannot run the {isa} variant (it runs {picked})")
        _native_write_matches(dtype, kv_dtype)
    finally:
        extensions.cap_isa(cpu_attention.EXTENSION)


def _native_write_matches(dtype: torch.dtype, kv_dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(9)
    query_lens, seq_lens = MIXED
    batch = make_paged_batch(query_lens, seq_lens, 16, 3, 64, dtype, generator, head_major=True)
    meta = _meta(batch)
    fused_kv = torch.randn(meta.num_tokens, 5, 2, 64, generator=generator).to(dtype)
    fused_kv[0, 1] = 0.0
    k, v = fused_kv[:, 1:4, 0], fused_kv[:, 1:4, 1]
    caches = []
    for writer in (write_kv, cpu_attention.write_kv):
        k_cache = allocate_kv_cache(batch.k_cache.shape[0], 16, 3, 64, kv_dtype)
        v_cache = allocate_kv_cache(batch.k_cache.shape[0], 16, 3, 64, kv_dtype)
        writer(k_cache, v_cache, k, v, meta)
        caches.append((k_cache, v_cache))
    (k_torch, v_torch), (k_native, v_native) = caches
    assert torch.equal(k_native, k_torch) and torch.equal(v_native, v_torch)
    assert k_native.abs().sum() > 0


@pytest.mark.usefixtures("fused")
def test_native_write_refuses_a_slot_outside_the_pool() -> None:
    _, batch, meta = _case(([1], [40]), 4, 2, 32, 16, torch.float32)
    slots = meta.slot_mapping.clone()
    slots[0] = batch.k_cache.shape[0] * 16
    k = torch.zeros(1, 2, 32)
    with pytest.raises(RuntimeError, match="out of range"):
        torch.ops.slipstream.paged_kv_write(
            k, k, head_major(batch.k_cache), head_major(batch.v_cache), slots
        )


@pytest.mark.usefixtures("fused")
def test_q_may_be_a_view_with_a_token_stride() -> None:
    """The model's q is a split of a wider [T, heads + kv_heads, D] tensor."""
    q, batch, meta = _case(MIXED, 8, 4, 64, 16, torch.float32, seed=5)
    wide = torch.cat([q, torch.full((q.shape[0], 4, 64), float("nan"))], dim=1)
    view = wide[:, :8]
    assert not view.is_contiguous()
    out = cpu_attention.paged_attention(view, batch.k_cache, batch.v_cache, meta, 0.125)
    _assert_matches_dense(out, q, batch, 0.125)


@pytest.mark.usefixtures("fused")
def test_wrapper_rejects_what_the_kernel_cannot_read() -> None:
    q, batch, meta = _case(([1, 3], [9, 3]), 4, 2, 32, 16, torch.float32)
    token_major = batch.k_cache.contiguous()
    with pytest.raises(ValueError, match="head-major"):
        cpu_attention.paged_attention(q, token_major, token_major, meta, 1.0)
    with pytest.raises(ValueError, match="share"):
        cpu_attention.paged_attention(q.bfloat16(), batch.k_cache, batch.v_cache, meta, 1.0)
    with pytest.raises(ValueError, match="packed"):
        cpu_attention.paged_attention(q[:, ::2], batch.k_cache, batch.v_cache, meta, 1.0)
    with pytest.raises(ValueError, match="metadata"):
        cpu_attention.paged_attention(q[:2], batch.k_cache, batch.v_cache, meta, 1.0)


@pytest.mark.usefixtures("fused")
def test_op_refuses_block_ids_outside_the_pool() -> None:
    q, batch, meta = _case(([1], [40]), 4, 2, 32, 16, torch.float32)
    tables = meta.block_tables.clone()
    tables[0, 2] = batch.k_cache.shape[0]  # one past the last block
    with pytest.raises(RuntimeError, match="out of range"):
        torch.ops.slipstream.paged_attention(
            q, head_major(batch.k_cache), head_major(batch.v_cache), tables, meta.seq_lens_t,
            meta.query_start_loc, 1.0,
        )  # fmt: skip


def _compiled_layer(backend_name: str):  # type: ignore[no-untyped-def]
    def layer(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta):  # type: ignore[no-untyped-def]
        out = cpu_attention.paged_attention(q * 1.5, k_cache, v_cache, meta, 0.125)
        return out.relu() + 1.0

    return layer, torch.compile(layer, backend=backend_name, fullgraph=True)


@pytest.mark.usefixtures("fused")
def test_compiles_as_one_opaque_op() -> None:
    """fullgraph: the op (through its fake kernel) does not break the graph."""
    torch._dynamo.reset()
    q, batch, meta = _case(MIXED, 8, 4, 64, 16, torch.float32)
    eager, compiled = _compiled_layer("aot_eager")
    expected = eager(q, batch.k_cache, batch.v_cache, meta)
    torch.testing.assert_close(compiled(q, batch.k_cache, batch.v_cache, meta), expected)


@pytest.mark.slow
@pytest.mark.usefixtures("fused")
def test_compiles_under_inductor() -> None:
    from slipstream.kernels.cpu_features import forced

    if forced() != "native":
        # Inductor picks its own vector ISA from the machine, not from the answer
        # this run is forced to (torch's dispatch is capped, inductor's code is not).
        pytest.skip(f"inductor does not follow a forced CPU answer ({forced()})")
    torch._dynamo.reset()
    q, batch, meta = _case(MIXED, 8, 4, 64, 16, torch.bfloat16)
    eager, compiled = _compiled_layer("inductor")
    expected = eager(q, batch.k_cache, batch.v_cache, meta)
    torch.testing.assert_close(compiled(q, batch.k_cache, batch.v_cache, meta), expected)


# ------------------------------------------------------------------ selection


@pytest.mark.usefixtures("fused")
def test_auto_on_the_cpu_picks_the_fused_kernel(home: Path) -> None:
    assert backend.resolve_backend("auto", CPU, home=home) == "cpu"
    assert backend.resolve_backend("cpu", CPU, home=home) == "cpu"
    assert backend.paged_attention_for("cpu") is cpu_attention.paged_attention
    assert backend.write_kv_for("cpu") is cpu_attention.write_kv
    assert backend.copy_blocks_for("cpu") is copy_blocks


def test_switched_off_the_extension_is_never_built(
    home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def refuse(*args: object, **kwargs: object) -> bool:
        raise AssertionError("the extension was consulted")

    monkeypatch.setattr(cpu_attention, "is_available", refuse)
    assert backend.resolve_backend("auto", CPU, home=home, build_extension=False) == "torch"
    with pytest.raises(backend.BackendUnavailable, match="disabled"):
        backend.resolve_backend("cpu", CPU, home=home, build_extension=False)
    assert backend.resolve_backend("torch", CPU) == "torch"


def test_cpu_backend_is_refused_off_the_cpu() -> None:
    with pytest.raises(backend.BackendUnavailable, match="CPU"):
        backend.resolve_backend("cpu", torch.device("cuda"))


def test_a_failed_build_falls_back_to_torch_with_one_log_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    broken = tmp_path / "paged_attention_cpu.cpp"
    broken.write_text("#error this source does not compile\n")
    monkeypatch.setattr(cpu_attention, "SOURCE", broken)  # what is_available() builds by default
    monkeypatch.setattr(extensions, "_outcomes", {})
    with caplog.at_level(logging.INFO, logger="slipstream.kernels"):
        assert backend.resolve_backend("auto", CPU, home=tmp_path) == "torch"
        assert not cpu_attention.is_available(tmp_path)  # the outcome is kept: no second build
    ours = [r for r in caplog.records if r.name.startswith("slipstream")]
    assert len(ours) == 1 and len(caplog.records) == 1  # nothing from torch's build either
    assert "torch attention path" in ours[0].getMessage()
    assert "does not compile" in (cpu_attention.failure(broken) or "")
    with pytest.raises(backend.BackendUnavailable, match="unavailable"):
        backend.resolve_backend("cpu", CPU, home=tmp_path)


def test_build_key_follows_the_source(tmp_path: Path) -> None:
    one, two = tmp_path / "one.cpp", tmp_path / "two.cpp"
    one.write_text("int x;\n")
    two.write_text("int y;\n")
    assert cpu_attention.build_key(one) != cpu_attention.build_key(two)
    assert cpu_attention.build_key(one) == cpu_attention.build_key(one)
    assert cpu_attention.extension_dir(tmp_path, one).parent == tmp_path / "cache" / "extensions"


def test_metadata_carries_seq_lens_as_a_tensor() -> None:
    meta = attention.build_attention_metadata(
        [2, 1], [5, 6], [[3, 1], [0, 4]], 4, CPU, torch.float32
    )
    assert meta.seq_lens_t.dtype == torch.int64 and meta.seq_lens_t.tolist() == [5, 6]
