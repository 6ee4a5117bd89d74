"""What the scheduler answers about itself: queue lengths, pool usage and
the counters the engine's stats and metrics read. Read-only, except
``observe_idle``, which passes idle time on to the policy."""

from __future__ import annotations

from .policy_base import PreemptionMode
from .request import Request
from .scheduler_state import SchedulerState


class SchedulerQueries(SchedulerState):
    """Queue, pool and counter queries."""

    @property
    def step(self) -> int:
        """Number of ``schedule()`` calls so far (= the latest plan's step)."""
        return self._step

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_swapped(self) -> int:
        return len(self._swapped)

    @property
    def num_used_device_blocks(self) -> int:
        return self.device_pool.num_used

    @property
    def num_free_device_blocks(self) -> int:
        return self.device_pool.num_free

    @property
    def num_used_host_blocks(self) -> int:
        return self.host_pool.num_used

    @property
    def num_free_host_blocks(self) -> int:
        return self.host_pool.num_free

    @property
    def num_recompute_preemptions(self) -> int:
        return self._num_preemptions[PreemptionMode.RECOMPUTE]

    @property
    def num_swap_preemptions(self) -> int:
        return self._num_preemptions[PreemptionMode.SWAP]

    @property
    def num_draft_tokens(self) -> int:
        """Draft tokens in the plans updated so far (speculative decoding)."""
        return self._num_draft_tokens

    @property
    def num_accepted_tokens(self) -> int:
        """Of ``num_draft_tokens``, those the model agreed with."""
        return self._num_accepted_tokens

    @property
    def num_expired(self) -> int:
        """Requests finished DEADLINE_EXCEEDED by ``schedule()``."""
        return self._num_expired

    @property
    def num_abandoned(self) -> int:
        """Requests ended early by ``schedule()`` as unable to make a time limit."""
        return self._num_abandoned

    @property
    def num_prefix_queried_tokens(self) -> int:
        """Prompt tokens looked up in the prefix cache, once per request at its
        first admission (a re-admission after a recompute is not counted)."""
        return self._num_prefix_queried_tokens

    @property
    def num_prefix_hit_tokens(self) -> int:
        """Of ``num_prefix_queried_tokens``, those found cached (not
        prefilled): the requests' ``num_cached_tokens`` summed."""
        return self._num_prefix_hit_tokens

    @property
    def num_prefix_waits(self) -> int:
        """Steps waiting requests sat out because another request's chunk in
        that step computed their next uncached blocks (prefix_sharing.py);
        what the wait saved shows in ``num_prefix_hit_tokens``."""
        return self._num_prefix_waits

    @property
    def num_lost_swaps(self) -> int:
        """Swapped requests sent back to wait because their shared prefix was evicted."""
        return self._num_lost_swaps

    @property
    def num_cached_device_blocks(self) -> int:
        """Device blocks in the prefix cache (held or evictable)."""
        return self.device_pool.num_cached

    @property
    def num_overload_refused(self) -> dict[int, int]:
        """Arrivals turned away as Overloaded, by priority class."""
        return {c: n for (c, reason), n in self._num_refused.items() if reason == "overloaded"}

    @property
    def num_refused_for_capacity(self) -> dict[tuple[int, str], int]:
        """Arrivals turned away at the door for capacity, by (priority
        class, reason): ``overloaded`` (Overloaded) or ``queue_full``
        (QueueFull: the waiting queue at its bound, nothing to shed)."""
        return dict(self._num_refused)

    def overload_estimate(self, now: float | None = None) -> float | None:
        """The policy's load estimate (``SchedulingPolicy.overload_estimate``)
        as of ``now``: one read while no work arrives falls with the time."""
        return self.policy.overload_estimate(now)

    @property
    def step_time_pace(self) -> float | None:
        """Measured over predicted step time, as the cost model averages it
        (``CostModel.pace``); None without a cost model or before its first
        measured step. Far below 1, the model predicts steps slower than they
        run, and every deadline estimate with it."""
        model = self._cost_model
        if model is None or model.num_samples == 0:
            return None
        return model.pace

    @property
    def num_held_back(self) -> int:
        """Times batch shaping held a request's tokens out of a step."""
        return self._num_held_back

    def num_shed_by_priority(self) -> dict[int, int]:
        """Requests shed from a full queue, by priority class (ascending)."""
        return dict(sorted(self._num_shed.items()))

    def has_unfinished(self) -> bool:
        return bool(self._requests)

    def observe_idle(self, idle_s: float) -> None:
        """No request was live for ``idle_s`` seconds (the policy's estimates
        relax toward what a lone request costs)."""
        self.policy.observe_idle(idle_s)

    def live_req_ids(self) -> list[str]:
        """Ids of every unfinished request, in arrival order."""
        return list(self._requests)

    def get_request(self, req_id: str) -> Request | None:
        """The live request with this id (None once finished)."""
        return self._requests.get(req_id)

    def counts_by_priority(self) -> dict[int, dict[str, int]]:
        """``{priority: {"waiting": n, "running": n, "swapped": n}}`` over live
        requests, classes in ascending order."""
        counts: dict[int, dict[str, int]] = {}
        queues = (("waiting", self._waiting), ("running", self._running.values()))
        for name, reqs in (*queues, ("swapped", self._swapped.values())):
            for req in reqs:
                row = counts.setdefault(req.priority, {"waiting": 0, "running": 0, "swapped": 0})
                row[name] += 1
        return dict(sorted(counts.items()))
