"""The tiny model end to end with the Triton attention backend (under the
interpreter) produces the same greedy tokens as the torch backend.

Skipped until the engine takes ``attention_backend`` and reports the backend
it resolved in ``engine.info.attention_backend``; the Triton run also counts
kernel launches, so a backend option that is accepted but ignored fails.
"""

from __future__ import annotations

import dataclasses

import pytest
from triton_modules import count_launches, interpreted

from slipstream.service.engine.config import EngineConfig

pytestmark = pytest.mark.triton

# Short prompts; a 16-token step budget chunks the longer ones, so prefill
# chunks over cached blocks share steps with other sequences' decodes.
PROMPTS = [[5, 17, 300, 42, 9], list(range(100, 123)), [7] * 3 + list(range(900, 937)), [11]]
MAX_NEW_TOKENS = [6, 8, 5, 7]


def _engine(backend: str):
    from slipstream.service.engine.loader import load_engine

    return load_engine(
        EngineConfig(
            model="tiny", dtype="float32", attention_backend=backend, block_size=16,
            num_device_blocks=64, num_host_blocks=8, max_num_batched_tokens=16,
        )
    )  # fmt: skip


def _generate(engine) -> list[list[int]]:
    from slipstream.service.engine.events import RequestSpec

    requests = [
        RequestSpec(req_id=f"r{i}", prompt_token_ids=p, max_new_tokens=n, ignore_eos=True)
        for i, (p, n) in enumerate(zip(PROMPTS, MAX_NEW_TOKENS, strict=True))
    ]
    try:
        results = engine.generate(requests)
    finally:
        engine.shutdown()
    return [r.token_ids for r in results]


def test_triton_backend_matches_torch_greedy_tokens(monkeypatch):
    if "attention_backend" not in {f.name for f in dataclasses.fields(EngineConfig)}:
        pytest.skip("the engine has no attention_backend option yet")
    decode = interpreted("triton_paged_decode")
    prefill = interpreted("triton_paged_prefill")
    kv_write = interpreted("triton_kv_write")
    triton_engine = _engine("triton")
    resolved = triton_engine.info.attention_backend
    if resolved != "triton":
        triton_engine.shutdown()
        pytest.skip(f"the engine does not run the Triton backend yet (reports {resolved!r})")
    torch_engine = _engine("torch")
    assert torch_engine.info.attention_backend == "torch"
    expected = _generate(torch_engine)
    kernels = (decode._decode_kernel, prefill._prefill_kernel, kv_write._kv_write_kernel)
    launches = [count_launches(monkeypatch, kernel) for kernel in kernels]
    tokens = _generate(triton_engine)
    assert all(count() > 0 for count in launches), "the Triton kernels were not called"
    assert tokens == expected
    assert [len(t) for t in tokens] == MAX_NEW_TOKENS
