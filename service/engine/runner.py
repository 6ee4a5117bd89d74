"""The model runner: executes one ``StepPlan`` — block swaps and copies, then
one forward over the ragged batch, then sampling. It makes no policy
decision; everything it does is spelled out by the plan.

KV pools, one (K, V) pair per layer (logical shapes; stored head-major, see
kernels/kv_layout.py)::

    device pool  k_cache[num_device_blocks, block_size, num_kv_heads, head_dim]
    host pool    k_cache[num_host_blocks,   block_size, num_kv_heads, head_dim]

On a CUDA device the host pool would be pinned CPU memory; on the CPU both
pools are ordinary tensors and a swap is a copy between them, which still
frees device blocks for more urgent work.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import structlog
import torch

from slipstream.kernels.attention import build_attention_metadata
from slipstream.kernels.backend import copy_blocks_for
from slipstream.kernels.compute_thread import sleeps_per_region
from slipstream.kernels.kv_layout import allocate_kv_cache, row_width
from slipstream.kernels.logit_adjustments import (
    AdjustmentPlan,
    LogitAdjustments,
    adjustment_tensors,
)
from slipstream.kernels.sampling import sample
from slipstream.kernels.sampling_speculative import accept_greedy, verify_drafts
from slipstream.scheduler.plan import ScheduledSeq, StepPlan, with_pending_tokens
from slipstream.service.engine.events import TokenLogprobs
from slipstream.service.engine.grammar import Matcher, mask_logits
from slipstream.service.engine.request_tokens import RequestLookup, RequestTokens
from slipstream.service.engine.token_logprobs import LogprobRows
from slipstream.service.models.llama import LlamaModel

KVPool = list[tuple[torch.Tensor, torch.Tensor]]

log = structlog.get_logger(__name__)

# Voluntary context switches a parallel region above which the engine's OpenMP
# workers sleep between regions (0 where they spin; 0.6-2.0 where they sleep).
SLEEPING_WORKERS = 0.3


def _why_asleep() -> dict[str, object]:
    """The likely cause of sleeping workers, for the log: a host whose other
    processes already keep its CPUs busy (its 1-minute load at least its
    CPUs: the workers lose their CPUs between regions, and no change to this
    process wakes them), else a second OpenMP team in this process."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    if cpus and load >= cpus:
        return {
            "load_1m": round(load, 2),
            "cpus": cpus,
            "detail": "the host is busy: other processes take the CPUs the engine's "
            "workers need, so they sleep and wake between a step's parallel regions "
            "(slower steps); give the server CPUs of its own, or fewer --threads",
        }
    return {
        "detail": "another thread of this process keeps an OpenMP team, so each "
        "parallel region of a step puts the engine's workers to sleep and wakes "
        "them (slower steps): run CPU torch work before serving on a thread "
        "that ends (kernels/compute_thread.py)",
    }


def allocate_pool(
    model: LlamaModel, num_blocks: int, block_size: int, commit: bool = False
) -> KVPool:
    """``commit``: back the whole pool with memory now (see ``allocate_kv_cache``)."""
    cfg = model.config
    shape = (num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
    return [
        (
            allocate_kv_cache(*shape, model.kv_dtype, commit=commit),
            allocate_kv_cache(*shape, model.kv_dtype, commit=commit),
        )
        for _ in range(cfg.num_layers)
    ]


def kv_bytes_per_block(model: LlamaModel, block_size: int) -> int:
    cfg = model.config
    element_size = torch.empty((), dtype=model.kv_dtype).element_size()
    row = row_width(cfg.head_dim, model.kv_dtype) * element_size
    return 2 * cfg.num_layers * block_size * cfg.num_kv_heads * row


@dataclass(frozen=True, slots=True)
class StepResult:
    """Sampled token per request that sampled this step, and the
    log-probabilities of those that asked for them. ``verified``: for each
    sequence that carried drafts, every token its step yields (the accepted
    drafts, then the model's own; ``Scheduler.update``), the first of them
    its ``sampled`` token."""

    sampled: dict[str, int]
    num_tokens: int
    logprobs: dict[str, TokenLogprobs] = field(default_factory=dict)
    verified: dict[str, list[int]] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class DoneStep:
    """A launched step that already ran (``launch`` on the CPU): its result."""

    step_result: StepResult

    def result(self) -> StepResult:
        return self.step_result


class ModelRunner:
    def __init__(
        self,
        model: LlamaModel,
        num_device_blocks: int,
        num_host_blocks: int,
        block_size: int,
        commit_kv_memory: bool = False,
    ) -> None:
        self.model = model
        self.block_size = block_size
        started = time.perf_counter()
        self.device_pool = allocate_pool(model, num_device_blocks, block_size, commit_kv_memory)
        self.host_pool = allocate_pool(model, num_host_blocks, block_size, commit_kv_memory)
        if commit_kv_memory:
            # Seconds per GiB where a VM gives a process's freed memory back
            # to its host and must be asked for it again (docs/performance.md).
            seconds = time.perf_counter() - started
            blocks = num_device_blocks + num_host_blocks
            gib = blocks * kv_bytes_per_block(model, block_size) / 2**30
            log.info("kv_pools_committed", gib=round(gib, 2), seconds=round(seconds, 2))
        self._copy_blocks = copy_blocks_for(model.attention_backend)
        self._last_sampled: dict[str, int] = {}  # the latest launch's, for pending tokens
        # Where the sampler scales its rows, kept from step to step (see sample_tensors).
        self._sampling_scratch = torch.empty(0)
        self._tokens = RequestTokens()  # what penalties are over

    def use_requests(self, requests: RequestLookup) -> None:
        """Where the sampler's penalties read each request's tokens (the engine's records)."""
        self._tokens.use(requests)

    def on_engine_thread(self) -> None:
        """Says in the log when the engine thread's OpenMP workers sleep between
        parallel regions: another thread of the process has run torch's parallel
        CPU work and keeps a team of its own (kernels/compute_thread.py), and
        every step's regions then sleep and wake."""
        sleeps = sleeps_per_region()
        if sleeps is not None and sleeps > SLEEPING_WORKERS:
            log.warning("openmp_workers_sleep", sleeps_per_region=round(sleeps, 2), **_why_asleep())

    def launch(self, plan: StepPlan, matchers: dict[str, Matcher] | None = None) -> DoneStep:
        """Runs ``plan`` now (the CPU has nothing to overlap with), taking its
        pending tokens from the step launched before it; see ``Engine``'s
        ``plan_ahead``."""
        result = self.execute(with_pending_tokens(plan, self._last_sampled), matchers)
        # A request whose drafts a step verifies is planned again only after
        # that step's update (Scheduler.schedule): never with a pending token.
        self._last_sampled = result.sampled
        return DoneStep(result)

    @torch.inference_mode()
    def execute(self, plan: StepPlan, matchers: dict[str, Matcher] | None = None) -> StepResult:
        """``matchers``: of the constrained sampled rows, by req_id (grammar.py);
        their logits are masked before sampling."""
        if plan.swap_out:
            self._copy_blocks(self.device_pool, self.host_pool, plan.swap_out)
        if plan.swap_in:
            self._copy_blocks(self.host_pool, self.device_pool, plan.swap_in)
        if plan.copies:
            self._copy_blocks(self.device_pool, self.device_pool, plan.copies)
        if not plan.seqs:
            return StepResult({}, 0)
        return self._forward(plan, matchers)

    def _scratch(self, numel: int) -> torch.Tensor:
        """The sampler's scratch, grown to ``numel`` float32s when smaller."""
        if self._sampling_scratch.numel() < numel:
            self._sampling_scratch = torch.empty(numel)
        return self._sampling_scratch

    def _forward(self, plan: StepPlan, matchers: dict[str, Matcher] | None) -> StepResult:
        token_ids: list[int] = []
        positions: list[int] = []
        query_lens: list[int] = []
        seq_lens: list[int] = []
        sample_rows: list[int] = []
        sampled_seqs = []
        # Sequences with drafts sample at each of their positions; their rows
        # come after every other sequence's one (see _verify).
        draft_rows: list[int] = []
        drafting_seqs = []
        for seq in plan.seqs:
            num_new = len(seq.token_ids)
            token_ids.extend(seq.token_ids)
            positions.extend(range(seq.start_pos, seq.start_pos + num_new))
            query_lens.append(num_new)
            seq_lens.append(seq.start_pos + num_new)
            if seq.sample and seq.num_drafts:
                draft_rows.extend(range(len(token_ids) - 1 - seq.num_drafts, len(token_ids)))
                drafting_seqs.append(seq)
            elif seq.sample:
                sample_rows.append(len(token_ids) - 1)
                sampled_seqs.append(seq)
        meta = build_attention_metadata(
            query_lens,
            seq_lens,
            [seq.block_ids for seq in plan.seqs],
            self.block_size,
            torch.device("cpu"),
            self.model.dtype,
            for_torch_path=self.model.attention_backend == "torch",
        )
        wanted = LogprobRows.of(
            [s.req_id for s in sampled_seqs], [s.sampling for s in sampled_seqs]
        )
        adjusting = self._tokens.plan(sampled_seqs, self.model.config.vocab_size)
        # Every row greedy, none asking for log-probabilities, masked or
        # adjusting its logits: the LM head picks the tokens without logits
        # where it can.
        greedy = (
            self.model.picks_greedy
            and wanted is None
            and matchers is None
            and adjusting is None
            and all(s.sampling.is_greedy for s in sampled_seqs)
            and all(s.sampling.is_greedy for s in drafting_seqs)
        )
        logits = self.model.forward(
            torch.tensor(token_ids, dtype=torch.long),
            torch.tensor(positions, dtype=torch.long),
            self.device_pool,
            meta,
            torch.tensor(sample_rows + draft_rows, dtype=torch.long),
            greedy,
        )
        verified: dict[str, list[int]] = {}
        if drafting_seqs:
            verified = _verify(logits[len(sample_rows) :], drafting_seqs, greedy, self._scratch)
            logits = logits[: len(sample_rows)]
        if not sampled_seqs:
            return StepResult({k: v[0] for k, v in verified.items()}, len(token_ids), {}, verified)
        taken = None if wanted is None else wanted.log_probs(logits)  # before sampling scales
        if matchers is not None:  # after the log-probabilities: the model's, unmasked
            mask_logits(logits, [s.req_id for s in sampled_seqs], matchers)
        tokens = (
            logits.tolist()
            if greedy
            else sample(
                logits,
                [s.sampling.temperature for s in sampled_seqs],
                [s.sampling.top_k for s in sampled_seqs],
                [s.sampling.top_p for s in sampled_seqs],
                [s.sampling.seed for s in sampled_seqs],
                [s.output_index for s in sampled_seqs],
                scratch=self._scratch(len(sampled_seqs) * logits.shape[-1]),
                adjustments=_adjustments(adjusting, token_ids, sample_rows),
                min_ps=[s.sampling.min_p for s in sampled_seqs],
            )
        )
        sampled = {s.req_id: t for s, t in zip(sampled_seqs, tokens, strict=True)}
        for req_id, tokens_of in verified.items():
            sampled[req_id] = tokens_of[0]
        if wanted is None or taken is None:
            return StepResult(sampled, len(token_ids), {}, verified)
        picked = wanted.pick(taken, torch.tensor(tokens))
        return StepResult(sampled, len(token_ids), picked.read(), verified)


def _verify(
    rows: torch.Tensor,
    seqs: list[ScheduledSeq],
    is_greedy_ids: bool,
    scratch: Callable[[int], torch.Tensor],
) -> dict[str, list[int]]:
    """The verified tokens of the drafting ``seqs`` from their rows (``num_drafts
    + 1`` each, in order): logits, or the greedy ids where ``is_greedy_ids``
    (kernels/sampling_speculative.py). No drafting request asks for
    log-probabilities, penalties, a bias or a constraint (scheduler/step_planning.py)."""
    drafts = [s.token_ids[len(s.token_ids) - s.num_drafts :] for s in seqs]
    if is_greedy_ids:
        verified = accept_greedy(rows.tolist(), drafts)
    else:
        verified = verify_drafts(
            rows,
            drafts,
            [s.sampling.temperature for s in seqs],
            [s.sampling.top_k for s in seqs],
            [s.sampling.top_p for s in seqs],
            [s.sampling.seed for s in seqs],
            [s.output_index for s in seqs],
            scratch=scratch(rows.numel()),
            min_ps=[s.sampling.min_p for s in seqs],
        )
    return {s.req_id: tokens for s, tokens in zip(seqs, verified, strict=True)}


def _adjustments(
    plan: AdjustmentPlan | None, token_ids: list[int], sample_rows: list[int]
) -> LogitAdjustments | None:
    """``plan``'s tensors on the CPU, each sampled row's last input token from the step's."""
    if plan is None:
        return None
    return adjustment_tensors(plan, torch.tensor([token_ids[i] for i in sample_rows]))
