"""Test doubles for the scheduler: a paged fake runner and a token-exact
reference, so tests check the plan the way a real runner would consume it.

The fake runner keeps a paged "KV cache" whose slots hold the token id written
at that position. Its "model" reads a sequence's whole context back *through
the block table* and hashes it into the next token. Any accounting bug — a
block reused while still live, a wrong table, a lost swap — changes what is
read back, and so changes the tokens. Shared (prefix-cached) blocks are
read by several sequences; the runner checks that nobody writes one.
"""

from __future__ import annotations

import zlib
from collections import Counter
from collections.abc import Callable, Sequence

from slipstream.scheduler import (
    BlockPool,
    FinishReason,
    PreemptionMode,
    Request,
    RequestOutput,
    Scheduler,
    SchedulerConfig,
    StepPlan,
)
from slipstream.scheduler.plan import PENDING_TOKEN, with_pending_tokens
from slipstream.scheduler.policy_base import FcfsPolicy

VOCAB = 97
EOS = 0


def next_token(context: Sequence[int]) -> int:
    """A deterministic "greedy model": the next token depends on the whole context."""
    acc = 17
    for token in context:
        acc = (acc * 31 + token + 7) % 1_000_003
    return acc % VOCAB


def reference_outputs(
    req: Request, model: Callable[[Sequence[int]], int] = next_token
) -> list[int]:
    """The tokens ``req`` produces when it runs alone, never preempted."""
    context = list(req.prompt_token_ids)
    outputs: list[int] = []
    while len(outputs) < req.max_new_tokens:
        token = model(context)
        outputs.append(token)
        context.append(token)
        if not req.ignore_eos and token in req.eos_token_ids:
            break
    return outputs


class PagedFakeRunner:
    """Executes a ``StepPlan`` against block-structured token storage.
    ``model`` is the "greedy model" (``next_token`` unless given); a
    sequence with drafts samples at each position and is verified as the
    real runner verifies greedy rows (the picks up to the first that is not
    its draft), its tokens in ``verified``."""

    def __init__(
        self,
        config: SchedulerConfig,
        pool: BlockPool | None = None,
        model: Callable[[Sequence[int]], int] = next_token,
    ) -> None:
        self.block_size = config.block_size
        self.model = model
        self.verified: dict[str, list[int]] = {}  # the latest execute's
        self.pool = pool  # the scheduler's device pool: written blocks must be unshared
        self.device: list[list[int | None]] = [
            [None] * config.block_size for _ in range(config.num_device_blocks)
        ]
        self.host: list[list[int | None]] = [
            [None] * config.block_size for _ in range(config.num_host_blocks)
        ]

    def execute(self, plan: StepPlan) -> dict[str, int]:
        for device_id, host_id in plan.swap_out:
            self.host[host_id] = list(self.device[device_id])
        for host_id, device_id in plan.swap_in:
            self.device[device_id] = list(self.host[host_id])
        for src, dst in plan.copies:
            self.device[dst] = list(self.device[src])
        self._check_writes_are_private(plan)
        for seq in plan.seqs:
            for offset, token in enumerate(seq.token_ids):
                self._write(seq.block_ids, seq.start_pos + offset, token)
        sampled = {}
        self.verified = {}
        for seq in plan.seqs:
            if seq.sample:
                end = seq.start_pos + len(seq.token_ids)
                context = [self._read(seq.block_ids, pos) for pos in range(end)]
                if not seq.num_drafts:
                    sampled[seq.req_id] = self.model(context)
                    continue
                first = end - seq.num_drafts
                tokens = []
                for stop in range(first, end + 1):
                    tokens.append(self.model(context[:stop]))
                    if stop == end or tokens[-1] != context[stop]:
                        break
                sampled[seq.req_id] = tokens[0]
                self.verified[seq.req_id] = tokens
        return sampled

    def _write(self, block_ids: list[int], pos: int, token: int) -> None:
        block = block_ids[pos // self.block_size]  # IndexError = table too short
        self.device[block][pos % self.block_size] = token

    def _read(self, block_ids: list[int], pos: int) -> int:
        value = self.device[block_ids[pos // self.block_size]][pos % self.block_size]
        if value is None:
            raise AssertionError(f"position {pos} read before it was written")
        return value

    def _check_writes_are_private(self, plan: StepPlan) -> None:
        """A block a sequence writes is in no other table of the plan and,
        in the pool, has that one holder: shared blocks are read-only."""
        holders: Counter[int] = Counter()
        for seq in plan.seqs:
            holders.update(set(seq.block_ids))
        for seq in plan.seqs:
            first = seq.start_pos // self.block_size
            last = (seq.start_pos + len(seq.token_ids) - 1) // self.block_size
            for block in seq.block_ids[first : last + 1]:
                assert holders[block] == 1, f"{seq.req_id} writes block {block}, shared in the plan"
                if self.pool is not None:
                    assert self.pool.ref_count(block) == 1, f"{seq.req_id} writes shared {block}"


class SwapPolicy(FcfsPolicy):
    """FCFS that swaps its victims whenever the host pool has room."""

    name = "fcfs-swap"

    def preemption_mode(self, victim: Request, can_swap: bool, now: float) -> PreemptionMode:
        return PreemptionMode.SWAP if can_swap else PreemptionMode.RECOMPUTE


def make_request(
    req_id: str,
    prompt_len: int,
    max_new_tokens: int,
    *,
    arrival: float = 0.0,
    priority: int = 0,
    deadline: float | None = None,
    ignore_eos: bool = True,
) -> Request:
    seed = zlib.crc32(req_id.encode())
    prompt = [(seed + 3 * i) % (VOCAB - 1) + 1 for i in range(prompt_len)]
    return Request(
        req_id=req_id,
        prompt_token_ids=prompt,
        max_new_tokens=max_new_tokens,
        eos_token_ids=(EOS,),
        ignore_eos=ignore_eos,
        priority=priority,
        arrival_time=arrival,
        deadline=deadline,
    )


def check_pools(scheduler: Scheduler) -> None:
    """Pool invariants plus: a used block's reference count is its number of
    live holders (one, unless it is a shared, cached prefix block), a host
    block has exactly one, and no request holds a block twice."""
    for pool in (scheduler.device_pool, scheduler.host_pool):
        pool.check()
        assert pool.num_free + pool.num_used == pool.num_blocks
    device_held: Counter[int] = Counter()
    host_held: list[int] = []
    for req_id in scheduler.live_req_ids():
        req = scheduler.get_request(req_id)
        assert req is not None
        assert len(set(req.block_ids)) == len(req.block_ids)
        device_held.update(req.block_ids)
        host_held += req.host_block_ids
    device = scheduler.device_pool
    assert len(device_held) == device.num_used
    for block_id, holders in device_held.items():
        assert device.ref_count(block_id) == holders
        assert holders == 1 or device.is_cached(block_id)
    assert len(host_held) == len(set(host_held)) == scheduler.host_pool.num_used


def check_plan_rules(plan: StepPlan) -> None:
    """Anti-thrash rules: nothing preempted in a step runs in it, and a step
    that preempts swaps nothing back in."""
    preempted = set(plan.preempted_req_ids)
    assert not preempted & {seq.req_id for seq in plan.seqs}
    assert not (preempted and plan.swap_in)


class SelfFirstPolicy(FcfsPolicy):
    """Preempts the *most* urgent candidate — usually the requester itself.
    A poor policy on purpose: the scheduler must stay correct with any victim
    choice among the candidates it offers."""

    name = "self-first"

    def choose_victim(
        self, candidates: Sequence[Request], requester: Request, now: float
    ) -> Request | None:
        return min(candidates, key=lambda r: self.urgency_key(r, now), default=None)


class Driver:
    """Runs schedule -> fake runner -> update and records every finish.

    ``ahead``: plans each step before the previous step's update, as an
    engine overlapping the host with the device does — schedule(N+1,
    ahead) -> run N+1 -> update(N)."""

    def __init__(
        self,
        scheduler: Scheduler,
        ahead: bool = False,
        model: Callable[[Sequence[int]], int] = next_token,
    ) -> None:
        self.scheduler = scheduler
        self.runner = PagedFakeRunner(scheduler.config, scheduler.device_pool, model)
        self.ahead = ahead
        self.now = 0.0
        self.finishes: dict[str, list[FinishReason]] = {}
        self.outputs: dict[str, list[int]] = {}
        self.plans: list[StepPlan] = []
        self._pending: tuple[StepPlan, dict[str, int], dict[str, list[int]]] | None = None

    def step(
        self, dt: float = 1.0, between: Callable[[StepPlan], None] | None = None
    ) -> list[RequestOutput]:
        """One step; ``between(plan)`` runs after the plan ran, before its update."""
        self.now += dt
        plan = self.scheduler.schedule(self.now, ahead=self._pending is not None)
        self.plans.append(plan)
        for finished in plan.finished:
            self.finishes.setdefault(finished.req_id, []).append(finished.reason)
        check_plan_rules(plan)
        self._check_within_limits(plan)
        previous = {} if self._pending is None else self._pending[1]
        for seq in plan.seqs:  # pending only as a decode's one token
            assert PENDING_TOKEN not in seq.token_ids or seq.token_ids == [PENDING_TOKEN], seq
        sampled = self.runner.execute(with_pending_tokens(plan, previous))
        verified = self.runner.verified
        if between is not None:
            between(plan)
        if self.ahead:
            pending, self._pending = self._pending, (plan, sampled, verified)
            if pending is None:
                return []
            plan, sampled, verified = pending
        outputs = self.scheduler.update(plan, sampled, self.now, verified=verified)
        self.record(outputs)
        return outputs

    def _check_within_limits(self, plan: StepPlan) -> None:
        """No sequence is planned past its request's token limits."""
        for seq in plan.seqs:
            req = self.scheduler.get_request(seq.req_id)
            assert req is not None
            assert seq.start_pos + len(seq.token_ids) < self.scheduler.config.max_model_len
            assert not seq.sample or seq.output_index + seq.num_drafts < req.max_new_tokens, seq

    def flush(self) -> None:
        """Updates the plan still awaiting its results (planning ahead)."""
        if self._pending is not None:
            plan, sampled, verified = self._pending
            self._pending = None
            self.record(self.scheduler.update(plan, sampled, self.now, verified=verified))

    def record(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            self.outputs.setdefault(out.req_id, []).extend(out.new_token_ids)
            if out.finish_reason is not None:
                self.finishes.setdefault(out.req_id, []).append(out.finish_reason)

    def abort(self, req_id: str) -> None:
        out = self.scheduler.abort_request(req_id)
        if out is not None:
            self.record([out])

    def run_until_idle(self, max_steps: int = 10_000) -> None:
        for _ in range(max_steps):
            if not self.scheduler.has_unfinished():
                self.flush()
                if not self.scheduler.has_unfinished():
                    return
            self.step()
        raise AssertionError(f"not idle after {max_steps} steps")
