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
saturated engine. ``OverloadShedder`` measures two rates over the recent
arrivals and steps:

- the offered load: the weight arriving per second (every class), over the
  last ``WINDOW`` arrivals;
- the service rate: the weight a saturated step gets through per second of
  predicted step time, slowed by the cost model's measured overrun (1.0 for
  a full batch of decodes that runs as predicted; less when prefill steps
  or a fixed cost not shared by a full batch dilute it).

When offered load exceeds ``TARGET_UTILIZATION`` of the service rate, the
excess fraction ``f = 1 - target * service / offered`` of the arriving work
must go. The sheddable arrivals of the window (classes above 0 with a
deadline) are ranked least urgent class first and, within a class, heaviest
first; the threshold is the rank at which they carry ``f`` of the window's
work, and an arrival ranked before it is refused. So a class is shed only
once refusing every arrival of the less urgent classes would not cover the
excess: priority decides first, weight within it. Below capacity nothing is
refused. Class 0 is never shed. O(1) per arrival and step; the threshold is
recomputed (a sort of the window) every ``REFRESH_ARRIVALS`` arrivals, and at
the first arrival after the engine had nothing to do: a threshold set during
an overload that has since drained must not turn away the next arrivals.
"""

from __future__ import annotations

import math
from collections import deque

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


class OverloadShedder:
    """Offered load, service rate, and the rank past which sheddable
    arrivals are refused."""

    __slots__ = (
        "_arrivals",
        "_service_rate",
        "_since_refresh",
        "_threshold",
        "_window_weight",
    )

    def __init__(self) -> None:
        # (arrival time, weight, class if sheddable else None) of the window.
        self._arrivals: deque[tuple[float, float, int | None]] = deque()
        self._window_weight = 0.0
        self._service_rate = 1.0
        self._threshold = NO_THRESHOLD
        self._since_refresh = 0

    @property
    def threshold(self) -> tuple[float, float]:
        """``(class, weight)``: a sheddable arrival of a less urgent class,
        or of this class and heavier, is refused; ``NO_THRESHOLD`` when not
        overloaded."""
        return self._threshold

    @property
    def service_rate(self) -> float:
        """Weight a saturated engine serves per second (1.0 = as the cost model predicts)."""
        return self._service_rate

    def offered_load(self) -> float:
        """Weight arriving per second over the window (0 until it says anything)."""
        arrivals = self._arrivals
        if len(arrivals) < MIN_ARRIVALS:
            return 0.0
        span = arrivals[-1][0] - arrivals[0][0]
        if span <= 0:
            return math.inf
        # The first arrival opens the span: its weight is not inside it.
        return (self._window_weight - arrivals[0][1]) / span

    def utilization(self) -> float:
        """Offered load over the service rate: above 1, work must go."""
        return self.offered_load() / self._service_rate

    def admits(
        self,
        now: float,
        weight: float,
        shed_class: int | None,
    ) -> bool:
        """Records an arrival of ``weight``; False to refuse it. ``shed_class``:
        its priority class if it may be shed, else None."""
        arrivals = self._arrivals
        arrivals.append((now, weight, shed_class))
        self._window_weight += weight
        if len(arrivals) > WINDOW:
            self._window_weight -= arrivals.popleft()[1]
        self._since_refresh += 1
        if self._since_refresh >= REFRESH_ARRIVALS:
            self._since_refresh = 0
            self._refresh()
        if shed_class is None:
            return True
        threshold_class, threshold_weight = self._threshold
        return shed_class < threshold_class or (
            shed_class == threshold_class and weight <= threshold_weight
        )

    def observe_step(self, work_s: float, predicted_s: float, overrun: float) -> None:
        """A saturated step (it left waiting work out for want of room; only
        such a step measures the service rate) that the cost model predicted
        at ``predicted_s``, carrying ``work_s`` of weight; measured steps run
        ``overrun`` past their predictions on average."""
        if predicted_s <= 0 or work_s <= 0:
            return
        rate = work_s / (predicted_s * (1.0 + max(0.0, overrun)))
        self._service_rate += _SERVICE_EWMA * (rate - self._service_rate)

    def shifted(self, shift_s: float) -> OverloadShedder:
        """A copy on a clock ``shift_s`` ahead of this one's: the state a
        twin replaying from another time origin starts with."""
        twin = OverloadShedder()
        twin._arrivals = deque((t + shift_s, w, c) for t, w, c in self._arrivals)
        twin._window_weight = self._window_weight
        twin._service_rate = self._service_rate
        twin._threshold = self._threshold
        twin._since_refresh = self._since_refresh
        return twin

    def observe_idle(self) -> None:
        """Nothing was live: the next arrival recomputes the threshold (its
        window's span now holds the idle time, which lowers the offered load)."""
        self._since_refresh = REFRESH_ARRIVALS - 1

    def _refresh(self) -> None:
        utilization = self.utilization()
        if utilization <= TARGET_UTILIZATION:
            self._threshold = NO_THRESHOLD
            return
        excess = (1.0 - TARGET_UTILIZATION / utilization) * self._window_weight
        ranked = sorted(((c, w) for _, w, c in self._arrivals if c is not None), reverse=True)
        shed = 0.0
        # All sheddable work is not enough: refuse every sheddable arrival.
        threshold: tuple[float, float] = (0.0, -math.inf)
        for cls, weight in ranked:
            shed += weight
            if shed >= excess:
                # The arrival that completes the excess is refused too: the
                # threshold steps just below its weight.
                threshold = (float(cls), math.nextafter(weight, -math.inf))
                break
        self._threshold = threshold
