"""SLO-aware batch shaping: keep the step short enough for urgent work.

A step's time grows with its batch (decodes, prefill tokens, the context
they read). A request with ``n`` steps left and ``t`` seconds to its
deadline needs steps of at most ``t / n`` seconds: its *step ceiling*. The
shaper walks one step's candidates in urgency order (most urgent first) and
admits each one's tokens only while the predicted step time stays within
the ceilings of everything already admitted of a more urgent priority
class::

    urgency order:  c0 (ceiling 40 ms)   c1 (ceiling 90 ms)   c2 ...  c2 ...
    predicted step: 12 ms                14 ms                ...     41 ms > 40 ms: held back

Only a more urgent class holds work back — except within class 0, the
interactive class whose attainment is the promise: elsewhere, holding one
request back for another of its class trades one miss for another and
costs throughput (measured: 3-10 points of overall attainment at 1.5x load).

Held-back work stays where it is (running work keeps its KV blocks) and
runs again in the first step whose ceilings allow it: the capacity comes
back as soon as the urgency passes. A prefill chunk that does not fit is
shortened to the tokens that do before it is held back — the smallest
change that keeps the urgent set on time. A request whose ceiling is below
the step that more urgent work already makes constrains nobody: it would
miss anyway, and holding others back for it would only make them miss too.

The ceilings of work in the step cannot protect work that is not there yet:
a class-0 request that arrives while a long step runs (a prefill chunk of
less urgent work, say) waits out that step first. So the step also keeps a
*reserve*: the step ceiling that recent class-0 arrivals had when they
arrived (a low quantile of the last few, ``ArrivalReserve``), applied to
every less urgent candidate like the ceiling of admitted class-0 work, for
as long as class-0 requests keep arriving. Class-0 work itself answers only
to the ceilings of class-0 work present (measured: holding it to the reserve
too cost class 0 1.6 points at 0.8x load). The reserve never empties a step
(the first candidate is admitted as if there were none) and it is dropped
where no step could meet it.

A step holding any prefill may cost more than its tokens: on a GPU it runs
eagerly (~10 ms of launches) where a decode-only step replays a graph
(1.6-3.2 ms); the cost model's ``per_prefill_step_s``. That cost is paid
from slack, not pace: the step's first prefill is admitted only while every
more urgent admitted request, at the current step's time for each of its
remaining steps, still has ``PREFILL_STEP_SLACK`` times that cost to spare.
A request's per-step ceiling spreads its time evenly over its steps, so
held to its ceiling one eager step would never fit, and prefills would
wait behind every class-0 request (measured in simulation: class 0 held,
everything else starved).

Pure arithmetic on the cost model's coefficients: O(1) per candidate, and
for prefill candidates O(admitted) until the step holds a prefill or one is
turned away (the rest of that class and below are then turned away at once).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable

from .cost_model import CostModel
from .request import Request

# Spare steps a ceiling keeps (prediction noise, the step being planned).
CEILING_MARGIN_STEPS = 1.0
# More spare steps while a step planned before is still to finish (an engine
# planning ahead): a request's next step then ends a step later than its
# count says, and the one spare step above went to that. Simulated on an
# H200's loaded steps with deadlines from an idle engine's isolated time
# (``bench slo --sim --device-steps h200-loaded --engine-shape --plan-ahead
# --yardstick``, 1,000 requests, 1.5x, slack 4 8 16, seeds 0-1, cv 1 and 3):
# class 0 at 92.0-94.4 % with none, 98.3-100 % with 0.25, 99.1-100 % with
# 0.5 (all classes 78.6-91.4 % against 89.3-93.3 %), 99.0-100 % with 1
# (62.5-81.8 %).
IN_FLIGHT_MARGIN_STEPS = 0.5
# The reserve: over the last RESERVE_WINDOW class-0 arrivals, the ceiling
# that RESERVE_QUANTILE of them had at arrival or less; kept while arrivals
# continue (a gap of RESERVE_HORIZON_GAPS mean gaps, at least
# RESERVE_MIN_HORIZON_S, ends it).
RESERVE_WINDOW = 32
RESERVE_QUANTILE = 0.1
RESERVE_HORIZON_GAPS = 4.0
RESERVE_MIN_HORIZON_S = 1.0
# A step's fixed cost of holding a prefill (``per_prefill_step_s``: on a GPU,
# an eager step against a graphed decode) is paid from a constraining
# request's slack only while that slack holds this many of it: the rest keeps
# the request clear of the estimates that abandon hopeless work. Simulated
# on an H100's steps at 1.5x load, tight deadlines (as in
# tests/scheduler/test_sched_bimodal_steps.py; 300 requests, 3 seeds): 1 held
# class 0 at 32-61 %, 2 at 95-100 %, 3 at 100 %.
PREFILL_STEP_SLACK = 3.0


class ArrivalReserve:
    """The step ceilings recent class-0 requests had when they arrived."""

    __slots__ = ("_arrivals",)

    def __init__(self) -> None:
        self._arrivals: deque[tuple[float, float]] = deque(maxlen=RESERVE_WINDOW)

    def observe(self, now: float, ceiling_s: float) -> None:
        if math.isfinite(ceiling_s) and ceiling_s > 0:
            self._arrivals.append((now, ceiling_s))

    def shifted(self, shift_s: float) -> ArrivalReserve:
        """A copy on a clock ``shift_s`` ahead of this one's."""
        twin = ArrivalReserve()
        twin._arrivals.extend((t + shift_s, c) for t, c in self._arrivals)
        return twin

    def ceiling_s(self, now: float) -> float:
        """The reserve at ``now``; +inf when class-0 arrivals have stopped."""
        arrivals = self._arrivals
        if not arrivals:
            return math.inf
        first, last = arrivals[0][0], arrivals[-1][0]
        mean_gap = (last - first) / (len(arrivals) - 1) if len(arrivals) > 1 else 0.0
        if now - last > max(RESERVE_MIN_HORIZON_S, RESERVE_HORIZON_GAPS * mean_gap):
            return math.inf
        ceilings = sorted(c for _, c in arrivals)
        return ceilings[int(RESERVE_QUANTILE * (len(ceilings) - 1))]


class BatchShaper:
    """One step's shaping state. ``ceiling_of(req, now)`` is the policy's
    step ceiling for ``req`` (``math.inf`` when it has no time limit)."""

    __slots__ = (
        "_above",
        "_budgets",
        "_ceiling_of",
        "_ceilings",
        "_context_s",
        "_decode_s",
        "_has_prefill",
        "_last",
        "_now",
        "_num_admitted",
        "_prefill_s",
        "_prefill_step_refused",
        "_prefill_step_s",
        "_reserve_s",
        "_step_s",
        "_steps_of",
    )

    def __init__(
        self,
        cost: CostModel,
        now: float,
        ceiling_of: Callable[[Request, float], float],
        reserve_s: float = math.inf,
        steps_of: Callable[[Request], float] | None = None,
    ) -> None:
        c = cost.coefficients
        self._decode_s = c.per_decode_seq_s
        self._prefill_s = c.per_prefill_token_s
        self._context_s = c.per_context_token_s
        self._prefill_step_s = c.per_prefill_step_s  # paid once, by the step's first prefill
        self._has_prefill = False
        # The most urgent class whose prefill the step's fixed cost was refused
        # for: the constraints only grow, so every class from it down is refused.
        self._prefill_step_refused = math.inf
        self._step_s = c.base_s  # predicted forward time of what is admitted so far
        self._num_admitted = 0
        # A reserve no step can meet (below one decode) protects nobody.
        self._reserve_s = reserve_s if reserve_s > c.base_s + c.per_decode_seq_s else math.inf
        # Priority class -> the lowest ceiling among what is admitted of it.
        self._ceilings: dict[int, float] = {}
        # Class -> ``_ceiling_above`` of it, until ``_ceilings`` next changes.
        self._above: dict[int, float] = {}
        self._ceiling_of = ceiling_of
        # The fixed cost of a step holding a prefill is paid from slack, not
        # pace: a request ``steps`` steps from its limit at ``ceiling`` a step
        # has ``steps * (ceiling - step)`` to spare for it. Per admitted
        # constraining request: (class, ceiling * steps, steps).
        self._steps_of = steps_of
        self._budgets: list[tuple[int, float, float]] = []
        self._now = now
        # fit's cost and kind of the candidate it let in, for its commit
        self._last: tuple[Request | None, int, float, bool] = (None, 0, 0.0, False)

    @property
    def predicted_step_s(self) -> float:
        return self._step_s

    @property
    def ceiling_s(self) -> float:
        """The lowest ceiling among what is admitted (+inf: none)."""
        return min(self._ceilings.values(), default=math.inf)

    def _ceiling_above(self, priority: int) -> float:
        """The lowest ceiling among admitted work of a more urgent class (or
        of class 0, for class 0)."""
        lowest = self._above.get(priority)
        if lowest is None:
            lowest = math.inf
            for cls, ceiling in self._ceilings.items():
                if (cls < priority or cls == priority == 0) and ceiling < lowest:
                    lowest = ceiling
            self._above[priority] = lowest
        return lowest

    def fit(self, req: Request, num_new: int) -> int:
        """How many of ``num_new`` tokens ``req`` may schedule this step (0:
        held back) without pushing the step past the ceiling of admitted
        work of a more urgent class (class 0: of class 0 too)."""
        if num_new <= 0:
            return 0
        is_decode = _is_decode(req, num_new)
        limit = self._ceiling_above(req.priority)
        if req.priority > 0 and self._num_admitted:  # never the first candidate
            limit = min(limit, self._reserve_s)
        if self._prefill_step_s > 0 and not self._affords_prefill_step(req, is_decode):
            return 0
        cost = self._cost(req, num_new, is_decode)
        spare = limit - self._step_s
        if cost <= spare:  # always, below no ceiling (+inf)
            self._last = (req, num_new, cost, is_decode)
            return num_new
        if not is_decode:
            # Shorten a prefill chunk: each token costs its prefill and its context.
            per_token = self._prefill_s + self._context_s
            fixed = self._context_s * req.num_computed_tokens
            fits = int((spare - fixed) / per_token) if per_token > 0 else num_new
            if fits >= 1:
                return min(fits, num_new)
        return 0

    def fit_drafts(self, req: Request, num_drafts: int) -> int:
        """How many of ``num_drafts`` draft tokens the decode of ``req``,
        just let in by ``fit``, may carry under the same ceilings and its
        own. A draft speeds its request only where it is accepted, so it is
        priced as what it costs, a prefill token (``StepShape.of``), and
        takes no time that more urgent work, or ``req``'s own deadline on
        its estimate of one token a step, needs."""
        limit = min(self._ceiling_above(req.priority), self._ceiling_of(req, self._now))
        if req.priority > 0 and self._num_admitted:
            limit = min(limit, self._reserve_s)
        if self._prefill_step_s > 0 and not self._affords_prefill_step(req, False):
            return 0
        if limit == math.inf:
            return num_drafts
        last_req, _, cost, _ = self._last
        spare = limit - self._step_s - (cost if last_req is req else 0.0)
        per_token = self._prefill_s + self._context_s
        if per_token <= 0:
            return num_drafts if spare >= 0 else 0
        return max(0, min(num_drafts, int(spare / per_token)))

    def commit(self, req: Request, num_new: int, num_drafts: int = 0) -> None:
        """``req`` runs ``num_new`` tokens (and ``num_drafts`` draft tokens)
        this step: its cost joins the step and its ceiling (if it can still
        be met) joins the constraints."""
        last_req, last_num, cost, is_decode = self._last
        if last_req is not req or last_num != num_new:
            is_decode = _is_decode(req, num_new)
            cost = self._cost(req, num_new, is_decode)
        if num_drafts:
            cost += (self._prefill_s + self._context_s) * num_drafts
            is_decode = False  # the step holds prefill-priced tokens now
        self._step_s += cost
        self._num_admitted += 1
        ceiling = self._ceiling_of(req, self._now)
        if ceiling >= self._step_s and ceiling < self._ceilings.get(req.priority, math.inf):
            self._ceilings[req.priority] = ceiling
            self._above.clear()
        if self._prefill_step_s > 0:  # kept only where a step has such a cost
            if not self._has_prefill and not is_decode:
                self._has_prefill = True
            if self._steps_of is not None and self._step_s <= ceiling < math.inf:
                steps = self._steps_of(req)
                self._budgets.append((req.priority, ceiling * steps, steps))

    def _affords_prefill_step(self, req: Request, is_decode: bool) -> bool:
        """Whether the admitted work of a more urgent class (class 0: of
        class 0 too) can pay the step's fixed cost of holding a prefill out
        of its slack, should ``req`` be the step's first prefill."""
        if self._has_prefill or is_decode:
            return True
        if req.priority >= self._prefill_step_refused:
            return False
        step, needed = self._step_s, PREFILL_STEP_SLACK * self._prefill_step_s
        refused = any(
            (cls < req.priority or cls == req.priority == 0) and budget - steps * step < needed
            for cls, budget, steps in self._budgets
        )
        if refused:
            self._prefill_step_refused = req.priority
        return not refused

    def _cost(self, req: Request, num_new: int, is_decode: bool) -> float:
        computed = req.num_computed_tokens
        context = self._context_s * (computed + num_new)
        if is_decode:
            return self._decode_s + context
        return self._prefill_s * num_new + context


def _is_decode(req: Request, num_new: int) -> bool:
    """The cost model's notion (``StepShape.of``): one new token that samples
    an output after the first."""
    outputs = len(req.output_token_ids)
    return (
        num_new == 1
        and outputs > 0
        and len(req.prompt_token_ids) + outputs - req.num_computed_tokens == 1
    )
