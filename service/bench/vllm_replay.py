"""Replays a benchmark workload through vLLM's offline engine; run by
``vllm_peer`` under vLLM's own Python, as a script:

    python vllm_replay.py SPEC.json RESULT.json

It imports only vLLM and the standard library (vLLM lives in its own
environment, without Slipstream). SPEC holds the model folder, dtype, thread
binding, engine arguments, warm-up and timed requests; RESULT gets load and
warm-up times, the timed run's wall time and one timing per request, in
request order. Any failure exits non-zero with its traceback on stderr.

The timed run mirrors Slipstream's: every request is added at ``t0`` (prompt
token ids, greedy, EOS ignored, exactly ``max_tokens``), then the engine is
stepped until none is left. A request's first-token time and finish time are
stamped when ``step()`` hands back its first output and its final one, so
TTFT and latency are measured the way Slipstream's engine callbacks are.
"""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from typing import Any


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print(f"usage: {argv[0]} SPEC.json RESULT.json", file=sys.stderr)
        return 2
    with open(argv[1], encoding="utf-8") as f:
        spec = json.load(f)
    result = replay(spec)
    # Written whole to a temporary name first: a half-written result must never parse.
    tmp = argv[2] + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(result, f)
    os.replace(tmp, argv[2])
    return 0


def replay(spec: dict[str, Any]) -> dict[str, Any]:
    # vLLM reads its CPU settings from the environment when it is imported and
    # when it starts its engine process, so they are set before the import.
    for key, value in spec.get("env", {}).items():
        os.environ[key] = str(value)

    import vllm
    from vllm import LLM

    t_load = time.monotonic()
    llm = LLM(
        model=spec["model"],
        dtype=spec["dtype"],
        seed=0,
        **spec.get("engine_args", {}),
    )
    load_s = time.monotonic() - t_load

    t_warm = time.monotonic()
    _run(llm, spec["warmup"], "warmup")
    warmup_s = time.monotonic() - t_warm

    t0 = time.monotonic()
    timings = _run(llm, spec["requests"], "req", t0)
    wall_s = time.monotonic() - t0

    return {
        "vllm_version": vllm.__version__,
        "torch_version": _torch_version(),
        "python": platform.python_version(),
        "load_s": load_s,
        "warmup_s": warmup_s,
        "wall_s": wall_s,
        "requests": timings,
        "engine": _engine_settings(llm),
    }


def _run(
    llm: Any, requests: list[dict[str, Any]], prefix: str, t0: float | None = None
) -> list[dict[str, Any]]:
    """Add every request, step until all finish; per request its token count,
    finish time and first-token time in seconds from ``t0``."""
    from vllm import SamplingParams, TokensPrompt
    from vllm.sampling_params import RequestOutputKind

    start = time.monotonic() if t0 is None else t0
    engine = llm.llm_engine
    ids = [f"{prefix}-{i}" for i in range(len(requests))]
    for req_id, req in zip(ids, requests, strict=True):
        params = SamplingParams(
            max_tokens=req["max_tokens"],
            temperature=0.0,
            ignore_eos=True,
            # Deltas: each step hands back only that step's new tokens, so
            # the first output a request gets is its first token.
            output_kind=RequestOutputKind.DELTA,
        )
        engine.add_request(req_id, TokensPrompt(prompt_token_ids=req["prompt_token_ids"]), params)
    first: dict[str, float] = {}
    finished: dict[str, float] = {}
    num_tokens = dict.fromkeys(ids, 0)
    while engine.has_unfinished_requests():
        outputs = engine.step()
        now = time.monotonic()
        for out in outputs:
            made = sum(len(c.token_ids) for c in out.outputs)
            num_tokens[out.request_id] += made
            if made:
                first.setdefault(out.request_id, now)
            if out.finished:
                finished[out.request_id] = now
    missing = [i for i in ids if i not in finished]
    if missing:
        raise RuntimeError(f"vLLM left {len(missing)} requests unfinished: {missing[:5]}")
    return [
        {
            "num_output_tokens": num_tokens[i],
            "latency_s": finished[i] - start,
            "ttft_s": first[i] - start if i in first else None,
        }
        for i in ids
    ]


def _engine_settings(llm: Any) -> dict[str, Any]:
    """The knobs vLLM resolved for this run (its defaults included)."""
    config = llm.llm_engine.vllm_config
    fields = {
        "dtype": lambda: str(config.model_config.dtype).removeprefix("torch."),
        "max_model_len": lambda: config.model_config.max_model_len,
        "max_num_seqs": lambda: config.scheduler_config.max_num_seqs,
        "max_num_batched_tokens": lambda: config.scheduler_config.max_num_batched_tokens,
        "enable_chunked_prefill": lambda: config.scheduler_config.enable_chunked_prefill,
        "block_size": lambda: config.cache_config.block_size,
        "enable_prefix_caching": lambda: config.cache_config.enable_prefix_caching,
        "num_kv_blocks": lambda: config.cache_config.num_gpu_blocks,
        "compilation_mode": lambda: str(config.compilation_config.mode),
        "compilation_backend": lambda: config.compilation_config.backend,
    }
    settings = {}
    for name, read in fields.items():
        # Config layouts move between vLLM releases; a missing field is
        # recorded as unknown rather than failing a finished run.
        try:
            value = read()
        except AttributeError:
            value = None
        plain = isinstance(value, (str, int, float, bool, type(None)))
        settings[name] = value if plain else str(value)
    return settings


def _torch_version() -> str | None:
    try:
        import torch
    except ImportError:
        return None
    return str(torch.__version__)


if __name__ == "__main__":
    sys.exit(main(sys.argv))
