"""The tokens a step's penalties are over, for both runners: each adjusting
request's prompt and settled outputs, from the engine's records of its live
requests (``Engine`` hands its runner a ``RequestLookup``; the runner's
``use_requests``), as the int64 arrays ``kernels/logit_adjustments.py``
plans from.

A request sampling output ``k`` has ``k - 1`` settled outputs on the host;
output ``k - 1`` is the row's last input token, which a step planned ahead
holds on the device alone (the scheduler keeps a ``PENDING_TOKEN`` in its
place meanwhile), so the kernel reads that one where the step holds it::

    outputs   o0  o1  ...  o[k-2] | o[k-1]       sampling o[k]
              settled: host arrays  | the step's last input token

The arrays are kept from step to step: a request's prompt is read once, its
outputs as they settle (converting a row's 1,500 tokens from the lists cost
~60 us a step). A step keeps only the requests it adjusts, so one that ended
or sits out is let go at once (and read again if it comes back).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np

from slipstream.kernels.logit_adjustments import AdjustedRow, AdjustmentPlan, plan_adjustments
from slipstream.scheduler.plan import ScheduledSeq
from slipstream.scheduler.request import Request, SamplingParams

# req_id -> the scheduler's record of a live request, None once it has
# ended; called on the engine's thread, the one that updates the records.
RequestLookup = Callable[[str], Request | None]


class _Kept(NamedTuple):
    state: Request  # whose arrays these are (a req_id may come back as another request)
    prompt: np.ndarray  # int64; empty without a repetition penalty
    settled: np.ndarray  # int64: the leading outputs read so far


class RequestTokens:
    """A runner's view of its requests' tokens (``use`` gives it the engine's
    records) and the plan of a step's logit adjustments over them."""

    def __init__(self, requests: RequestLookup | None = None) -> None:
        self._requests = requests
        self._kept: dict[str, _Kept] = {}

    def use(self, requests: RequestLookup) -> None:
        self._requests = requests
        self._kept = {}

    def plan(self, sampled: Sequence[ScheduledSeq], vocab_size: int) -> AdjustmentPlan | None:
        """The adjustments of a step's sampled rows (``sampled``, in row
        order), None when no request asks for a penalty or a bias, or is
        short of its ``min_tokens`` (its EOS and stop ids banned). A request
        no longer live (its token is dropped), or a view without records,
        counts the row's last input token alone (and bans its stop ids alone)."""
        adjusted = []
        kept = {}
        for row, seq in enumerate(sampled):
            params = seq.sampling
            if not params.has_logit_adjustments:
                continue
            k = seq.output_index
            banning = k < params.min_tokens
            if params.min_tokens and not banning and not _penalises_or_biases(params):
                continue  # its min_tokens are out: nothing left to adjust
            prompt, settled = (), ()
            state = None if self._requests is None else self._requests(seq.req_id)
            if state is not None:
                kept[seq.req_id] = self._read(seq.req_id, state, params.repetition_penalty, k)
                prompt, settled = kept[seq.req_id].prompt, kept[seq.req_id].settled
            banned: tuple[int, ...] = ()
            if banning:
                eos = () if state is None else state.eos_token_ids  # () with ignore_eos
                banned = eos + params.stop_token_ids
            penalties = (params.presence_penalty, params.frequency_penalty)
            adjusted.append(
                AdjustedRow(row, *penalties, params.repetition_penalty, params.logit_bias,
                            prompt, settled, k > 0, banned)
            )  # fmt: skip
        self._kept = kept
        return plan_adjustments(adjusted, len(sampled), vocab_size)

    def _read(self, req_id: str, state: Request, repetition: float, k: int) -> _Kept:
        """``state``'s arrays for output ``k``: what was kept, with the
        outputs settled since read from its list."""
        kept = self._kept.get(req_id)
        if kept is None or kept.state is not state:
            prompt = state.prompt_token_ids if repetition != 1.0 else ()
            kept = _Kept(state, np.asarray(prompt, dtype=np.int64), np.empty(0, dtype=np.int64))
        num_settled = max(k - 1, 0)
        have = len(kept.settled)
        if have < num_settled:
            more = np.asarray(state.output_token_ids[have:num_settled], dtype=np.int64)
            return kept._replace(settled=np.concatenate([kept.settled, more]))
        return kept if have == num_settled else kept._replace(settled=kept.settled[:num_settled])


def _penalises_or_biases(params: SamplingParams) -> bool:
    return bool(
        params.presence_penalty
        or params.frequency_penalty
        or params.repetition_penalty != 1.0
        or params.logit_bias
    )
