"""The log-probabilities a step's requests asked for (``SamplingParams.logprobs``),
from its logits to the ``TokenLogprobs`` its token events carry.

Both runners take them in three moves around their sampler::

    wanted = LogprobRows.of(req_ids, sampling)   # host: which sampled rows ask
    taken = wanted.log_probs(logits)              # before sampling (it may scale
                                                  # the logits in place)
    picked = wanted.pick(taken, sampled_ids)      # after: host copies queued
    ...                                           # the step lands
    picked.read()                                 # {req_id: TokenLogprobs}

Nothing before ``read`` synchronises, so a GPU step reads them with its
sampled ids; a step where no request asks pays nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from slipstream.kernels.logprobs import log_probs, pick_logprobs
from slipstream.scheduler.plan import ScheduledSeq
from slipstream.scheduler.request import SamplingParams
from slipstream.service.engine.events import TokenLogprobs

# Rows a log_softmax takes at a time: [32, 49,152] float32 is 6 MiB, which
# the allocator reuses step after step; all 256 of a large CPU step at once
# (48 MiB) were fresh pages every step, 29 ms of faults where chunks take 6.
ROWS_PER_CHUNK = 32


class TakenLogProbs(NamedTuple):
    """The asking rows' float32 log-probabilities, in chunks of rows, and
    each chunk's row indices into the sampled rows, on the logits' device."""

    log_ps: list[torch.Tensor]
    rows: list[torch.Tensor]


@dataclass(frozen=True, slots=True)
class LogprobRows:
    """The sampled rows (indices into a step's sampled logits) whose requests
    want log-probabilities, each with its request and number of alternatives."""

    rows: list[int]
    req_ids: list[str]
    num_tops: list[int]

    @classmethod
    def of(cls, req_ids: Sequence[str], sampling: Sequence[SamplingParams]) -> LogprobRows | None:
        """The rows of ``req_ids`` (one per sampled row) that ask; None if none does."""
        rows = [row for row, params in enumerate(sampling) if params.logprobs is not None]
        if not rows:
            return None
        return cls(
            rows,
            [req_ids[row] for row in rows],
            [sampling[row].logprobs or 0 for row in rows],
        )

    @classmethod
    def of_plan(
        cls, sampled_req_ids: Sequence[str], seqs: Sequence[ScheduledSeq]
    ) -> LogprobRows | None:
        """The rows of ``sampled_req_ids`` (a step's sampled rows, in the
        runner's order) whose sequences in ``seqs`` ask; None if none does."""
        asking = {s.req_id: s.sampling for s in seqs if s.sampling.logprobs is not None}
        if not asking:
            return None
        no = SamplingParams()
        return cls.of(sampled_req_ids, [asking.get(req_id, no) for req_id in sampled_req_ids])

    def log_probs(self, logits: torch.Tensor) -> TakenLogProbs:
        """From the step's sampled logits (``[sampled rows, vocab]``)."""
        rows = torch.tensor(self.rows, dtype=torch.long)
        if logits.device.type != "cpu":  # one small upload, not a synchronising one
            rows = rows.pin_memory().to(logits.device, non_blocking=True)
        chunks = list(rows.split(ROWS_PER_CHUNK))
        return TakenLogProbs([log_probs(logits, chunk) for chunk in chunks], chunks)

    def pick(self, taken: TakenLogProbs, sampled: torch.Tensor) -> PickedLogprobs:
        """The sampled tokens' log-probabilities (``sampled``: the step's ids,
        one per sampled row) and the alternatives, copied to the host without
        waiting (read them once the step has landed)."""
        num_top = min(max(self.num_tops), taken.log_ps[0].shape[-1])  # a vocabulary under 20
        picks = [
            pick_logprobs(log_p, sampled.index_select(0, rows), num_top)
            for log_p, rows in zip(taken.log_ps, taken.rows, strict=True)
        ]
        chosen, top_values, top_ids = (torch.cat(parts) for parts in zip(*picks, strict=True))
        to_host = [t.to("cpu", non_blocking=True) for t in (chosen, top_values, top_ids)]
        return PickedLogprobs(self.req_ids, self.num_tops, *to_host)


@dataclass(frozen=True, slots=True)
class PickedLogprobs:
    """A step's log-probabilities on the host (landed once the step has)."""

    req_ids: list[str]
    num_tops: list[int]
    chosen: torch.Tensor
    top_values: torch.Tensor
    top_ids: torch.Tensor

    def read(self) -> dict[str, TokenLogprobs]:
        chosen, values, ids = self.chosen.tolist(), self.top_values.tolist(), self.top_ids.tolist()
        return {
            req_id: TokenLogprobs(chosen[i], ids[i][:num_top], values[i][:num_top])
            for i, (req_id, num_top) in enumerate(zip(self.req_ids, self.num_tops, strict=True))
        }
