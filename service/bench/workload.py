"""A seeded benchmark workload: prompts of random token ids with log-uniform
prompt and output lengths, identical for every engine that replays it.

Saved as JSON Lines, one request per line:
``{"prompt_token_ids": [...], "max_tokens": N}``.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

# Ids 0..3 are the special tokens of Slipstream's embedded tokenizers (pad,
# bos, eos, unk); a prompt made of them would behave unlike text.
NUM_SPECIAL_IDS = 4


@dataclass(frozen=True, slots=True)
class WorkloadRequest:
    """One request: ``max_tokens`` output tokens are generated, EOS ignored."""

    prompt_token_ids: list[int]
    max_tokens: int


# A few short requests every engine runs untimed before the clock starts, so
# first-call costs (allocation, kernel selection) stay out of the figures.
WARMUP_WORKLOAD = (
    WorkloadRequest(prompt_token_ids=list(range(5, 21)), max_tokens=4),
    WorkloadRequest(prompt_token_ids=list(range(5, 45)), max_tokens=4),
)


def make_workload(
    num_requests: int,
    seed: int,
    vocab_size: int,
    prompt_len: tuple[int, int] = (16, 512),
    output_len: tuple[int, int] = (8, 256),
) -> list[WorkloadRequest]:
    """``num_requests`` requests, a pure function of its arguments.

    Lengths are log-uniform over the inclusive ranges; token ids are uniform
    over ``[NUM_SPECIAL_IDS, vocab_size)``.
    """
    if num_requests < 0:
        raise ValueError(f"num_requests must be >= 0, got {num_requests}")
    if vocab_size <= NUM_SPECIAL_IDS:
        raise ValueError(f"vocab_size must exceed {NUM_SPECIAL_IDS}, got {vocab_size}")
    _check_range("prompt_len", prompt_len)
    _check_range("output_len", output_len)
    rng = random.Random(seed)
    requests = []
    for _ in range(num_requests):
        num_prompt = _log_uniform_int(rng, prompt_len)
        max_tokens = _log_uniform_int(rng, output_len)
        prompt = [rng.randrange(NUM_SPECIAL_IDS, vocab_size) for _ in range(num_prompt)]
        requests.append(WorkloadRequest(prompt_token_ids=prompt, max_tokens=max_tokens))
    return requests


def save_workload(path: str | Path, requests: Sequence[WorkloadRequest]) -> None:
    """Write ``requests`` as JSON Lines, in order."""
    with Path(path).open("w", encoding="utf-8") as f:
        for req in requests:
            line = {"prompt_token_ids": req.prompt_token_ids, "max_tokens": req.max_tokens}
            f.write(json.dumps(line, separators=(",", ":")) + "\n")


def load_workload(path: str | Path) -> list[WorkloadRequest]:
    """Read a workload written by ``save_workload`` (blank lines are skipped)."""
    requests = []
    with Path(path).open(encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            if line.strip():
                requests.append(_parse_line(json.loads(line), path, line_no))
    return requests


def workload_summary(requests: Sequence[WorkloadRequest]) -> dict[str, int]:
    """Counts a report needs to describe the workload."""
    prompt_lens = [len(r.prompt_token_ids) for r in requests]
    output_lens = [r.max_tokens for r in requests]
    return {
        "num_requests": len(requests),
        "num_prompt_tokens": sum(prompt_lens),
        "num_output_tokens": sum(output_lens),
        "min_prompt_len": min(prompt_lens, default=0),
        "max_prompt_len": max(prompt_lens, default=0),
        "min_output_len": min(output_lens, default=0),
        "max_output_len": max(output_lens, default=0),
    }


def _parse_line(obj: object, path: str | Path, line_no: int) -> WorkloadRequest:
    where = f"{path}:{line_no}"
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: expected a JSON object")
    ids = obj.get("prompt_token_ids")
    max_tokens = obj.get("max_tokens")
    if not isinstance(ids, list) or not ids or not all(_is_int(t) and t >= 0 for t in ids):
        raise ValueError(f"{where}: prompt_token_ids must be a non-empty list of ids >= 0")
    if not _is_int(max_tokens) or max_tokens < 1:
        raise ValueError(f"{where}: max_tokens must be an integer >= 1")
    return WorkloadRequest(prompt_token_ids=ids, max_tokens=max_tokens)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_range(name: str, bounds: tuple[int, int]) -> None:
    low, high = bounds
    if not 1 <= low <= high:
        raise ValueError(f"{name} must satisfy 1 <= low <= high, got {bounds}")


def _log_uniform_int(rng: random.Random, bounds: tuple[int, int]) -> int:
    """An integer in ``[low, high]`` whose log is uniform over ``[log low, log(high + 1))``."""
    low, high = bounds
    value = math.exp(rng.uniform(math.log(low), math.log(high + 1)))
    return min(high, max(low, int(value)))
