"""Backend selection and dispatch (``slipstream.kernels.backend``)."""

from __future__ import annotations

import pytest
import torch
from triton_modules import interpreted

from slipstream.kernels.attention import build_attention_metadata, paged_attention
from slipstream.kernels.block_copy import copy_blocks
from slipstream.kernels.kv_write import write_kv

pytestmark = pytest.mark.triton

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def backend():
    for name in ("triton_kv_write", "triton_paged_decode", "triton_paged_prefill"):
        interpreted(name)
    interpreted("triton_block_copy")
    from slipstream.kernels import backend

    return backend


def test_auto_is_triton_on_cuda_and_torch_on_cpu(backend):
    assert backend.resolve_backend("auto", torch.device("cuda", 0)) == "triton"
    # Without the fused CPU kernel (its own choice is tested in test_cpu_attention.py).
    assert backend.resolve_backend("auto", CPU, build_extension=False) == "torch"
    assert backend.resolve_backend("torch", torch.device("cuda")) == "torch"


def test_explicit_triton_on_cpu_needs_the_interpreter(backend, monkeypatch):
    assert backend.resolve_backend("triton", CPU) == "triton"  # TRITON_INTERPRET=1 here
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(backend.BackendUnavailable, match="CUDA"):
        backend.resolve_backend("triton", CPU)


def test_unknown_backend_is_rejected(backend):
    with pytest.raises(backend.BackendUnavailable, match="unknown"):
        backend.resolve_backend("cuda", CPU)
    with pytest.raises(backend.BackendUnavailable):
        backend.paged_attention_for("auto")  # dispatch takes a resolved name


def test_dispatch_returns_each_backends_callables(backend):
    from slipstream.kernels.triton_block_copy import triton_copy_blocks
    from slipstream.kernels.triton_kv_write import triton_write_kv

    assert backend.write_kv_for("torch") is write_kv
    assert backend.paged_attention_for("torch") is paged_attention
    assert backend.copy_blocks_for("torch") is copy_blocks
    assert backend.write_kv_for("triton") is triton_write_kv
    assert backend.paged_attention_for("triton") is backend.triton_paged_attention
    assert backend.copy_blocks_for("triton") is triton_copy_blocks


def test_step_tensors_are_built_once_per_metadata(backend):
    meta = build_attention_metadata([1, 5, 1], [9, 5, 3], [[0], [1], [2]], 16, CPU, torch.float32)
    step = backend.triton_step(meta)
    assert backend.triton_step(meta) is step  # the other layers of the step
    assert step.decode_seq_ids.tolist() == [0, 2] and step.decode_token_ids.tolist() == [0, 6]
    assert step.prefill_seq_ids.tolist() == [1] and step.max_prefill_query_len == 5
    assert step.max_decode_len == 9 and step.seq_lens.dtype == torch.int32
    other = build_attention_metadata([1, 5, 1], [9, 5, 3], [[0], [1], [2]], 16, CPU, torch.float32)
    assert backend.triton_step(other) is not step


def test_triton_and_torch_backends_agree_on_a_layer(backend):
    """write_kv then paged_attention, as the model runs one layer, through each backend."""
    generator = torch.Generator().manual_seed(11)
    tables = [[3, 0], [5], [1, 4, 2]]
    meta = build_attention_metadata([1, 7, 1], [20, 7, 40], tables, 16, CPU, torch.float32)
    q = torch.randn(9, 4, 32, generator=generator)
    k, v = torch.randn(9, 2, 32, generator=generator), torch.randn(9, 2, 32, generator=generator)
    cache = torch.randn(6, 16, 2, 32, generator=generator)
    outputs = []
    for name in ("torch", "triton"):
        k_cache, v_cache = cache.clone(), cache.clone() * 2
        backend.write_kv_for(name)(k_cache, v_cache, k, v, meta)
        outputs.append(backend.paged_attention_for(name)(q, k_cache, v_cache, meta, 0.2))
    torch.testing.assert_close(outputs[1], outputs[0], atol=2e-5, rtol=1e-4)


def test_a_step_checks_its_attention_inputs_once(backend, monkeypatch):
    """The layers after a step's first skip the input checks (``check=False``),
    and get the output the checked call gets."""
    from slipstream.kernels import triton_paged_decode, triton_paged_prefill

    generator = torch.Generator().manual_seed(5)
    meta = build_attention_metadata([1, 6, 1], [17, 6, 30], [[1, 0], [3], [2, 4]], 16, CPU,
                                    torch.float32)  # fmt: skip
    step = backend.triton_step(meta)
    q = torch.randn(8, 4, 32, generator=generator)
    k_cache, v_cache = (torch.randn(5, 16, 2, 32, generator=generator) for _ in range(2))
    calls = []
    for module in (triton_paged_decode, triton_paged_prefill):
        real = module._check
        monkeypatch.setattr(module, "_check", lambda *a, _real=real: calls.append(1) or _real(*a))
    checked = backend.triton_attention_for_step(q, k_cache, v_cache, meta, step, 0.2)
    assert len(calls) == 2  # the decode rows and the prefill chunk
    unchecked = backend.triton_attention_for_step(q, k_cache, v_cache, meta, step, 0.2, check=False)
    assert len(calls) == 2
    torch.testing.assert_close(unchecked, checked, rtol=0, atol=0)
    with pytest.raises(ValueError):  # the checks still guard the first layer
        backend.triton_attention_for_step(q[:, :3], k_cache, v_cache, meta, step, 0.2)
