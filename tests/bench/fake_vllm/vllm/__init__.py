"""A stand-in for the part of vLLM's offline API that ``vllm_replay.py``
uses, so the replay script and its driver are tested without vLLM.

Its engine makes one token per unfinished request per ``step()`` and hands
back deltas, as vLLM's does with ``RequestOutputKind.DELTA``. It logs the
start-up lines the driver parses. ``FAKE_VLLM_MODE`` picks a misbehaviour:
``crash`` (exits 3 while starting), ``hang`` (never starts), ``short`` (the
first timed request, ``req-0``, stops one token early).
"""

from __future__ import annotations

import os
import sys
import time
from types import SimpleNamespace
from typing import Any

from vllm.sampling_params import RequestOutputKind, SamplingParams

__version__ = "0.0.fake"
__all__ = ["LLM", "SamplingParams", "TokensPrompt"]


def TokensPrompt(prompt_token_ids: list[int]) -> dict[str, Any]:
    return {"prompt_token_ids": prompt_token_ids}


class LLM:
    def __init__(self, model: str, dtype: str, seed: int = 0, **engine_args: Any) -> None:
        mode = os.environ.get("FAKE_VLLM_MODE", "ok")
        print("INFO [default_loader.py:501] Loading weights took 0.25 seconds", flush=True)
        if mode == "crash":
            print("RuntimeError: Engine core initialization failed.", file=sys.stderr)
            sys.exit(3)
        if mode == "hang":
            time.sleep(3600)
        print(
            "INFO [core.py:402] init engine (profile, create kv cache, warmup model) took 1.50 s",
            flush=True,
        )
        self.llm_engine = _Engine(short=mode == "short")
        self.llm_engine.vllm_config = SimpleNamespace(
            model_config=SimpleNamespace(dtype=f"torch.{dtype}", max_model_len=2048),
            scheduler_config=SimpleNamespace(
                max_num_seqs=engine_args.get("max_num_seqs", 256),
                max_num_batched_tokens=engine_args.get("max_num_batched_tokens", 4096),
                enable_chunked_prefill=True,
            ),
            cache_config=SimpleNamespace(
                block_size=128, enable_prefix_caching=True, num_gpu_blocks=64
            ),
            compilation_config=SimpleNamespace(mode=2, backend="inductor"),
        )


class _Engine:
    def __init__(self, short: bool) -> None:
        self._short = short
        self._left: dict[str, int] = {}

    def add_request(self, request_id: str, prompt: dict[str, Any], params: SamplingParams) -> str:
        assert params.output_kind is RequestOutputKind.DELTA, "the replay relies on deltas"
        assert params.ignore_eos and params.temperature == 0.0
        assert prompt["prompt_token_ids"], "an empty prompt"
        cut = 1 if self._short and request_id == "req-0" else 0
        self._left[request_id] = params.max_tokens - cut
        return f"{request_id}-internal"

    def has_unfinished_requests(self) -> bool:
        return bool(self._left)

    def step(self) -> list[SimpleNamespace]:
        time.sleep(0.001)
        outputs = []
        for request_id in list(self._left):
            self._left[request_id] -= 1
            finished = self._left[request_id] <= 0
            if finished:
                del self._left[request_id]
            completion = SimpleNamespace(token_ids=[7])
            outputs.append(
                SimpleNamespace(request_id=request_id, outputs=[completion], finished=finished)
            )
        return outputs
