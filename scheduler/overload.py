"""Overload shedding: when more work arrives than the engine can serve,
turn away the heaviest less-urgent requests at the door.

Under a sustained load ``L`` above capacity, ``1 - 1/L`` of the arriving
work cannot be served whatever the order. A deadline scheduler alone gives
it up by *urgency*: whoever runs out of slack first is abandoned. Deadlines
scale with a request's size, so that is mostly short requests — many misses
for little work freed — and the compute already spent on them is lost.
Serving the most requests on time wants the opposite: give up the
*heaviest* requests (the most work per request), before they run (no compute
lost, and the caller learns at once and can go elsewhere).

A request's *weight* is its share of a full batch's machine time
(``CostModel.batched_seconds``): the work it costs, in seconds of a
saturated engine. ``OverloadShedder`` keeps an estimate of the load
(``load()``, offered work over the work the engine serves) tied to what the
engine is doing:

- the engine's state: whether its last step left waiting work out, for want
  of room (sequences, token budget or blocks) or held back by the batch
  shaper. While it did not — the queue is empty or the batch has room — the
  load reads at most 1 and *nothing is refused*, whatever the estimate says:
  a refusal then protects nobody;
- the offered load: the weight per second of the last ``WINDOW`` arrivals
  the engine took in, each counted for the work it really asks of the
  engine. A request that leaves before its work is done gives back the
  weight it did not use: at once when it was cancelled, disconnected or
  finished short of its expected output; when it expired or was abandoned
  or shed, only if the engine had room then (a deadline missed by an engine
  with room says nothing about load; one missed in a full engine is the
  overload itself). Arrivals refused as infeasible or for a full queue never
  count. Arrivals refused here count, since they are offered work (they are
  only ever made while the engine is full), until the engine idles: an
  engine that has drained is not kept believing it is overloaded. A step
  with room in the middle of an overload does not forget them: forgetting
  there (shedding and abandoned work empty the queue for a step now and
  then) left the estimate counting admitted work only, about the service
  rate, and shedding stalled until the window refilled (simulated CV 1 at
  1.25x and 1.5x: 1.2 and 2.0 points of attainment lost, compute spent on misses
  up 3-5x);
- the service rate: the weight a saturated step gets through per *measured*
  second (its predicted time times the cost model's ``pace``, measured over
  predicted): a cost model that over-predicts does not make the engine read
  as slow.

When the engine is full and the offered load exceeds ``TARGET_UTILIZATION``
of the service rate, the excess fraction ``f = 1 - target * service /
offered`` of the arriving work must go. The sheddable arrivals of the
window (classes above 0 with a deadline) are ranked least urgent class
first and, within a class, heaviest first; the threshold is the rank at
which they carry ``f`` of the window's work, and an arrival ranked before
it is refused. So a class is shed only once refusing every arrival of the
less urgent classes would not cover the excess: priority decides first,
weight within it. Class 0 is never shed. O(1) per arrival, departure and
step; the threshold is recomputed (a sort of the window) every
``REFRESH_ARRIVALS`` arrivals and at the first arrival after the engine
filled up.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections import deque
from itertools import accumulate

# Arrivals the offered load and the threshold are measured over. Long
# enough that a burst the queue absorbs within its deadlines (CV 3 arrivals
# at 0.8x) does not read as overload: a window of four deadlines, or one
# restarted whenever the engine idles, refused 5 % of such a workload.
WINDOW = 512
# Fewer arrivals than this say nothing about a rate: no shedding.
MIN_ARRIVALS = 64
# Recompute the threshold every this many arrivals.
REFRESH_ARRIVALS = 16
# The fraction of the service rate that may be offered before shedding:
# a queue at full utilization still misses its tightest deadlines.
TARGET_UTILIZATION = 0.97
# Weight of the newest saturated step in the service-rate average.
_SERVICE_EWMA = 0.01
# The threshold while nothing is refused.
NO_THRESHOLD = (math.inf, math.inf)


class _Arrival:
    """One arrival of the window; ``weight`` shrinks when the request gives
    back work it did not use."""

    __slots__ = ("is_refused", "req_id", "shed_class", "time", "weight")

    def __init__(
        self, time: float, weight: float, shed_class: int | None, is_refused: bool, req_id: str
    ) -> None:
        self.time = time
        self.weight = weight
        self.shed_class = shed_class
        self.is_refused = is_refused
        self.req_id = req_id


class OverloadShedder:
    """Offered load, service rate, the engine's room, and the rank past
    which sheddable arrivals are refused while the engine is full."""

    __slots__ = (
        "_arrivals",
        "_by_req",
        "_has_room",
        "_service_rate",
        "_since_refresh",
        "_threshold",
        "_window_weight",
    )

    def __init__(self) -> None:
        self._arrivals: deque[_Arrival] = deque()
        self._by_req: dict[str, _Arrival] = {}  # admitted arrivals still in the window
        self._window_weight = 0.0
        self._service_rate = 1.0
        self._threshold = NO_THRESHOLD
        self._since_refresh = 0
        # The engine's last step left no waiting work out for want of room.
        self._has_room = True

    @property
    def threshold(self) -> tuple[float, float]:
        """``(class, weight)``: a sheddable arrival of a less urgent class,
        or of this class and heavier, is refused; ``NO_THRESHOLD`` when not
        overloaded (always while the engine has room)."""
        return NO_THRESHOLD if self._has_room else self._threshold

    @property
    def has_room(self) -> bool:
        """The queue is empty or the batch has room (as of the last step)."""
        return self._has_room

    @property
    def service_rate(self) -> float:
        """Weight a saturated engine serves per measured second (1.0 = a full
        batch of decodes at the cost model's prediction)."""
        return self._service_rate

    def offered_load(self, now: float | None = None) -> float:
        """Weight arriving per second over the window (0 until it says
        anything), up to its last arrival or, given, up to ``now``: a window
        that nothing has joined for a while offers less per second."""
        arrivals = self._arrivals
        if len(arrivals) < MIN_ARRIVALS:
            return 0.0
        end = arrivals[-1].time if now is None else max(now, arrivals[-1].time)
        span = end - arrivals[0].time
        if span <= 0:
            return math.inf
        # The first arrival opens the span: its weight is not inside it.
        return max(0.0, self._window_weight - arrivals[0].weight) / span

    def utilization(self, now: float | None = None) -> float:
        """Offered load over the service rate, as measured: above 1, work must go."""
        return self.offered_load(now) / self._service_rate

    def load(self, now: float | None = None) -> float:
        """The overload estimate: ``utilization()``, but at most 1 while the
        engine has room (an engine with room serves what it is offered)."""
        utilization = self.utilization(now)
        return min(1.0, utilization) if self._has_room else utilization

    def refuses(self, weight: float, shed_class: int | None) -> bool:
        """Whether an arrival of ``weight`` would be refused now; records
        nothing. ``shed_class``: its class if it may be shed, else None."""
        if shed_class is None or self._has_room:
            return False
        if self._since_refresh >= REFRESH_ARRIVALS:
            self._refresh()
        threshold_class, threshold_weight = self._threshold
        return not (
            shed_class < threshold_class
            or (shed_class == threshold_class and weight <= threshold_weight)
        )

    def record(
        self,
        now: float,
        weight: float,
        shed_class: int | None,
        req_id: str = "",
        is_refused: bool = False,
    ) -> None:
        """An arrival the engine took in (``req_id`` names it for
        ``observe_departure``) or, ``is_refused``, one refused here."""
        arrival = _Arrival(now, weight, shed_class, is_refused, "" if is_refused else req_id)
        arrivals = self._arrivals
        arrivals.append(arrival)
        self._window_weight += weight
        if arrival.req_id:
            self._by_req[arrival.req_id] = arrival
        if len(arrivals) > WINDOW:
            old = arrivals.popleft()
            self._window_weight -= old.weight
            if old.req_id and self._by_req.get(old.req_id) is old:
                del self._by_req[old.req_id]
        self._since_refresh += 1

    def admits(self, now: float, weight: float, shed_class: int | None, req_id: str = "") -> bool:
        """``refuses`` and ``record`` in one: False to refuse the arrival."""
        refused = self.refuses(weight, shed_class)
        self.record(now, weight, shed_class, req_id, refused)
        return not refused

    def observe_departure(self, req_id: str, unserved: float, is_load_driven: bool) -> None:
        """``req_id`` left with ``unserved`` of its weight not done; a
        departure ``is_load_driven`` (expired, abandoned, shed) gives it back
        only while the engine has room."""
        arrival = self._by_req.pop(req_id, None)
        if arrival is None or (is_load_driven and not self._has_room):
            return
        given_back = min(arrival.weight, max(0.0, unserved))
        arrival.weight -= given_back
        self._window_weight -= given_back

    def observe_step(self, work_s: float, measured_s: float) -> None:
        """A saturated step (it left waiting work out for want of room; only
        such a step measures the service rate) carrying ``work_s`` of weight
        in ``measured_s`` (its prediction times the cost model's pace)."""
        self._set_room(False)
        if measured_s <= 0 or work_s <= 0:
            return
        rate = work_s / measured_s
        self._service_rate += _SERVICE_EWMA * (rate - self._service_rate)

    def observe_saturated(self) -> None:
        """A step left waiting work out for want of room (an empty one: no
        measure of the service rate)."""
        self._set_room(False)

    def observe_room(self) -> None:
        """A step left no waiting work out: the load reads at most 1 and
        nothing is refused (the refusals of the full engine still count as
        offered work: see ``observe_idle``)."""
        self._set_room(True)

    def observe_idle(self) -> None:
        """The engine had nothing to do: it has room, and the refusals of
        the full engine are forgotten (they must not make it read as
        overloaded once it has drained)."""
        self._set_room(True)
        for arrival in self._arrivals:
            if arrival.is_refused and arrival.weight:
                self._window_weight -= arrival.weight
                arrival.weight = 0.0

    def _set_room(self, has_room: bool) -> None:
        if has_room == self._has_room:
            return
        self._has_room = has_room
        if has_room:
            self._threshold = NO_THRESHOLD
        else:
            # Just filled up: the next arrival is judged on a fresh threshold.
            self._since_refresh = REFRESH_ARRIVALS

    def shifted(self, shift_s: float) -> OverloadShedder:
        """A copy on a clock ``shift_s`` ahead of this one's: the state a
        twin replaying from another time origin starts with (departures of
        the original's requests are not the twin's: it keeps no ids)."""
        twin = OverloadShedder()
        twin._arrivals = deque(
            _Arrival(a.time + shift_s, a.weight, a.shed_class, a.is_refused, "")
            for a in self._arrivals
        )
        twin._window_weight = self._window_weight
        twin._service_rate = self._service_rate
        twin._threshold = self._threshold
        twin._since_refresh = self._since_refresh
        twin._has_room = self._has_room
        return twin

    def _refresh(self) -> None:
        """The threshold: sheddable arrivals ranked least urgent class first
        and heaviest first within it, summed in that order until they carry
        the excess. Each class is summed whole where it cannot reach the
        excess and only the class that does is walked (its weights sorted,
        their running sums bisected): the same sums as one sort of every
        ``(class, weight)``, several times faster (the arrival that runs it
        waits on it, and so does the engine's next step, under the lock)."""
        self._since_refresh = 0
        utilization = self.utilization()
        if utilization <= TARGET_UTILIZATION:
            self._threshold = NO_THRESHOLD
            return
        excess = (1.0 - TARGET_UTILIZATION / utilization) * self._window_weight
        by_class: dict[int, list[float]] = {}
        for a in self._arrivals:
            if a.shed_class is not None:
                by_class.setdefault(a.shed_class, []).append(a.weight)
        shed = 0.0
        # All sheddable work is not enough: refuse every sheddable arrival.
        threshold: tuple[float, float] = (0.0, -math.inf)
        for cls in sorted(by_class, reverse=True):
            weights = sorted(by_class[cls], reverse=True)
            # Running sums in rank order (weights >= 0: non-decreasing).
            sums = list(accumulate(weights, initial=shed))
            i = bisect_left(sums, excess, 1)
            if i < len(sums):
                # The arrival that completes the excess is refused too: the
                # threshold steps just below its weight.
                threshold = (float(cls), math.nextafter(weights[i - 1], -math.inf))
                break
            shed = sums[-1]
        self._threshold = threshold
