"""Step-cost model: how long one engine step takes, as a function of its shape.

A step's time is modelled as linear in five features::

    seconds = base + per_prefill_token * prefill_tokens
                   + per_decode_seq    * decode_seqs
                   + per_context_token * context_tokens
                   + per_prefill_step  * (1 if prefill_tokens else 0)

where ``context_tokens`` is the sum over scheduled sequences of the tokens
their attention reads (``start_pos + len(token_ids)``). Moving one KV block
between the device and host pools costs ``swap_s_per_block`` (per direction).

``per_prefill_step`` is what a step pays once for holding any prefill: on a
GPU a decode-only step replays a CUDA graph and a step with a prefill chunk
runs eagerly, ~10 ms of kernel launches on an H100 whatever its size, against
1.6-3.2 ms for a graphed decode; without the term the fit averaged the two
(base 4.2 ms) and predicted neither. On the CPU it fits near zero.

Coefficients come from outside: the engine times a few synthetic steps at
start-up (``slipstream.service.engine.calibration.calibrate``) and then feeds every
measured step to ``CostModel.observe``, which refits them online by
exponentially weighted recursive least squares (older samples decay by
``forgetting`` per sample). Pure standard library; never reads a clock.

The fit is guarded against the two ways online least squares goes wrong on
a real host. A stall (a page-fault storm, a recompile, a noisy neighbour)
is one step many times its prediction: each sample is clipped to within
``OUTLIER_FACTOR`` of the prediction before it is fit, so a stall moves the
model no more than a step that ran twice as long, while a lasting change is
still followed, by up to that factor per step. And forgetting, over long
stretches of one step shape, inflates the covariance in the directions those
steps do not excite until one sample swings them (windup): the covariance
is kept within its prior, so no direction is ever trusted less than at the
start. Without the guards one stall could make the model predict every step
ten times too slow, the scheduler turn every request away as infeasible, and
no step ever run again to correct it.

Two more guards keep that state from lasting, since a model that refuses all
work gets no samples to correct it. No forward is ever predicted longer than
``MAX_DRIFT`` times what the start-up coefficients predict for it (a request
with a deadline that many times its calibrated time is always admitted, and
its steps refit the model). And while the engine has nothing to run, the fit
relaxes toward the start-up coefficients (``relax``, half-life
``RELAX_HALF_LIFE_S`` of idle time), so a model that talked itself out of
every request comes back to the calibration and lets work in again.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from operator import mul

from .plan import StepPlan

# Features are scaled to similar magnitudes so one initial covariance suits
# all five: [1, prefill tokens / 100, decode seqs / 10, context tokens / 1000,
# 1 if any prefill].
_SCALES = (1.0, 100.0, 10.0, 1000.0, 1.0)
_N = len(_SCALES)
_MIN_STEP_S = 1e-6
# Weight of the newest step in the average overrun; the overrun a margin is
# built from never exceeds MAX_OVERRUN (a start-up guess far off is refit in
# a few steps and must not starve everything meanwhile).
_OVERRUN_EWMA = 0.05
MAX_OVERRUN = 0.5
# A step's measured / predicted time, as the pace averages it, is kept in
# [1 / PACE_BOUND, PACE_BOUND]: a stall or a clock glitch is one sample.
PACE_BOUND = 10.0
# A measured step is fit as at most this many times its prediction (and at
# least its prediction divided by it): see the module docstring.
OUTLIER_FACTOR = 2.0
# No forward is predicted longer than this many times the start-up
# coefficients' prediction; idle time relaxes the fit toward them with this
# half-life (see the module docstring).
MAX_DRIFT = 10.0
RELAX_HALF_LIFE_S = 60.0


@dataclass(frozen=True, slots=True)
class StepShape:
    """What a step's time depends on. A sequence that samples after one new
    token is a decode; every other scheduled token is prefill, a decode's
    draft tokens included (each costs about a prefill token: ``StepPlan``)."""

    num_prefill_tokens: int = 0
    num_decode_seqs: int = 0
    num_context_tokens: int = 0
    num_swapped_blocks: int = 0  # swap-out plus swap-in block copies

    @staticmethod
    def of(plan: StepPlan) -> StepShape:
        prefill = decodes = context = 0
        for seq in plan.seqs:
            n = len(seq.token_ids)
            drafts = seq.num_drafts
            if n - drafts == 1 and seq.sample and seq.output_index > 0:
                decodes += 1
                prefill += drafts
            else:
                prefill += n
            context += seq.start_pos + n
        return StepShape(prefill, decodes, context, len(plan.swap_out) + len(plan.swap_in))


@dataclass(frozen=True, slots=True)
class CostCoefficients:
    """Seconds per unit of each feature. Defaults are a CPU-sized guess
    (the ``small`` model on two cores); calibrate before trusting them."""

    base_s: float = 0.010
    per_prefill_token_s: float = 0.0004
    per_decode_seq_s: float = 0.0015
    per_context_token_s: float = 0.000002
    swap_s_per_block: float = 0.00005
    per_prefill_step_s: float = 0.0  # once per step holding any prefill (module docstring)

    def __post_init__(self) -> None:
        for name in self.__slots__:
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0")

    def as_vector(self) -> list[float]:
        """The regression coefficients (swap cost apart), in ``_features`` order, scaled."""
        raw = (
            self.base_s,
            self.per_prefill_token_s,
            self.per_decode_seq_s,
            self.per_context_token_s,
            self.per_prefill_step_s,
        )
        return [c * s for c, s in zip(raw, _SCALES, strict=True)]

    @classmethod
    def from_vector(cls, theta: list[float], swap_s_per_block: float) -> CostCoefficients:
        """``as_vector``'s inverse: coefficients from scaled, non-negative ``theta``."""
        c = [t / s for t, s in zip(theta, _SCALES, strict=True)]
        return cls(c[0], c[1], c[2], c[3], swap_s_per_block, c[4])


class CostModel:
    """Predicts step and service times; refits itself from measured steps.

    Invariant: every prediction is positive and finite; coefficients used for
    prediction are clamped at zero (a noisy fit may dip below).
    """

    def __init__(
        self,
        coefficients: CostCoefficients | None = None,
        *,
        forgetting: float = 0.995,
        prior_weight: float = 10.0,
        overrun: float = 0.0,
        max_drift: float | None = MAX_DRIFT,
    ) -> None:
        """``overrun`` starts the model with a margin measured elsewhere (a
        simulated twin planning with the margin its engine held); it is
        clamped to ``[0, MAX_OVERRUN]`` and moves with ``observe`` (and back
        toward this start with ``relax``).
        ``max_drift``: how many times its start-up prediction a forward may
        be predicted at; None for a fit that starts from a guess, not a
        calibration. Each sample is clipped to within ``OUTLIER_FACTOR`` of
        the prediction and the coefficients kept non-negative, as a fit
        online must be; the start-up calibration's timed steps are fit as
        measured, by ``fit_relative``."""
        if max_drift is not None and max_drift < 1.0:
            raise ValueError(f"max_drift must be >= 1, got {max_drift}")
        if not 0.0 < forgetting <= 1.0:
            raise ValueError(f"forgetting must be in (0, 1], got {forgetting}")
        if prior_weight <= 0:
            raise ValueError(f"prior_weight must be > 0, got {prior_weight}")
        coeffs = coefficients if coefficients is not None else CostCoefficients()
        self._swap_s_per_block = coeffs.swap_s_per_block
        self._theta = coeffs.as_vector()
        self._start_coefficients = coeffs
        self._start_theta = [max(0.0, t) for t in self._theta]
        self._max_drift = math.inf if max_drift is None else max_drift
        # Covariance of the estimate; a small prior weight lets the first
        # measured samples dominate the start-up guess.
        self._prior_variance = 1.0 / prior_weight
        self._p = [[self._prior_variance if i == j else 0.0 for j in range(_N)] for i in range(_N)]
        self._forgetting = forgetting
        self._num_samples = 0
        self._overrun = min(MAX_OVERRUN, max(0.0, overrun))
        self._pace = 1.0 + self._overrun
        self._start_overrun = self._overrun
        self._refresh()

    def _refresh(self) -> None:
        """Recomputes what predictions read, after any coefficient change:
        predictions are far more frequent than refits."""
        self._clamped = [max(0.0, t) for t in self._theta]
        # Only a fit with some coefficient past MAX_DRIFT times its start can
        # predict past the cap: below that, the cap's dot product is skipped.
        self._may_drift_past = any(
            t > self._max_drift * s for t, s in zip(self._clamped, self._start_theta, strict=True)
        )
        self._coefficients = CostCoefficients.from_vector(self._clamped, self._swap_s_per_block)

    # -- coefficients ----------------------------------------------------

    @property
    def coefficients(self) -> CostCoefficients:
        return self._coefficients

    @property
    def num_samples(self) -> int:
        return self._num_samples

    @property
    def overrun(self) -> float:
        """How far measured steps ran past the prediction made just before
        them, as a fraction of it: an exponential average of
        ``max(0, measured / predicted - 1)``, at most ``MAX_OVERRUN``. What a
        deadline must keep in hand for the model's own error."""
        return self._overrun

    @property
    def pace(self) -> float:
        """Measured over predicted step time, an exponential average (same
        weight as ``overrun``) not clamped at 1: below 1 when steps run
        faster than predicted. What turns predicted seconds into measured
        ones, where ``overrun`` is the margin a deadline keeps (never
        negative)."""
        return self._pace

    def set_swap_cost(self, seconds_per_block: float) -> None:
        if seconds_per_block < 0:
            raise ValueError(f"swap cost must be >= 0, got {seconds_per_block}")
        self._swap_s_per_block = seconds_per_block
        self._refresh()

    def observe(self, shape: StepShape, seconds: float) -> None:
        """One measured step (forward only: swap time excluded). Exponentially
        weighted recursive least squares; O(25) float operations."""
        if seconds <= 0 or seconds != seconds:
            return  # a clock glitch, not information
        predicted = max(
            _MIN_STEP_S,
            self._forward_seconds(
                shape.num_prefill_tokens, shape.num_decode_seqs, shape.num_context_tokens
            ),
        )
        over = min(MAX_OVERRUN, max(0.0, seconds / predicted - 1.0))
        self._overrun += _OVERRUN_EWMA * (over - self._overrun)
        ratio = min(PACE_BOUND, max(1.0 / PACE_BOUND, seconds / predicted))
        self._pace += _OVERRUN_EWMA * (ratio - self._pace)
        seconds = min(predicted * OUTLIER_FACTOR, max(predicted / OUTLIER_FACTOR, seconds))
        x = _features(shape)
        theta, px, denom = self._update(x, seconds)
        self._theta = theta
        # P <- (P - P x xᵀ P / denom) / lam, written symmetric: the textbook
        # (P - gain pxᵀ) drifts from symmetric in rounding, and forgetting
        # grows the drift into a negative eigenvalue, after which the fit
        # diverges (seen after ~10^5 light-load steps).
        lam = self._forgetting
        self._p = [
            [(pij - pxi * pxj / denom) / lam for pij, pxj in zip(row, px, strict=True)]
            for row, pxi in zip(self._p, px, strict=True)
        ]
        self._bound_covariance()
        self._num_samples += 1
        self._refresh()

    def _update(self, x: list[float], seconds: float) -> tuple[list[float], list[float], float]:
        """One least-squares step toward ``seconds`` on features ``x``: the
        new coefficients, ``P x`` and the denominator the covariance update
        takes (of the features the step actually fit).

        Every coefficient stays non-negative: a cost is never negative, and a
        fit left free to go there wanders along the directions that steps of
        one shape cannot tell apart (a decode-only step's base against its
        per-sequence cost), one coefficient far negative and another far
        positive, cancelling on the steps it sees and predicting shapes it
        does not see wildly (measured on a light mix: a 0.5 ms decode
        predicted at 70 ms within three minutes). Clipping the updated
        coefficients at zero is not enough: a clipped coefficient raises the
        prediction the update had just lowered, the next step lowers it again
        through the others, and on steps of one shape the fit ran away
        (measured: 8 ms decodes predicted at 5.5 s within 20 steps, the
        coefficients at 1e17 within 200). So a coefficient the step would
        take below zero is held at zero and the step is refit on the rest
        (an active set): the prediction for the step's shape then always
        moves toward the measurement, never past it."""
        p = self._p
        free = [True] * _N  # coefficients the step fits (the rest held at zero)
        while True:
            u = [xi if f else 0.0 for xi, f in zip(x, free, strict=True)]
            # sum(map(mul, ...)): the products and their order of a generator's
            # sum, without a generator (this runs every step).
            px = [sum(map(mul, row, u)) for row in p]
            denom = self._forgetting + sum(map(mul, u, px))
            base = [t if f else 0.0 for t, f in zip(self._theta, free, strict=True)]
            error = seconds - sum(map(mul, base, u))
            theta = [
                t + v / denom * error if f else 0.0 for t, v, f in zip(base, px, free, strict=True)
            ]
            below = [i for i in range(_N) if free[i] and theta[i] < 0.0]
            if not below:
                return theta, px, denom
            for i in below:
                free[i] = False

    def relax(self, idle_s: float) -> None:
        """The engine had nothing to run for ``idle_s``: the fit moves toward
        the start-up coefficients, half the way per ``RELAX_HALF_LIFE_S``,
        and the pace and overrun measured against it toward their start (a
        margin a stall left behind must not outlast the fit it measured)."""
        if idle_s <= 0:
            return
        keep = idle_keep(idle_s)
        start_pace = 1.0 + self._start_overrun
        self._overrun = self._start_overrun + (self._overrun - self._start_overrun) * keep
        self._pace = start_pace + (self._pace - start_pace) * keep
        if self._theta == self._start_theta:
            return
        self._theta = [
            s + (t - s) * keep for t, s in zip(self._theta, self._start_theta, strict=True)
        ]
        self._refresh()

    def _bound_covariance(self) -> None:
        """Scales the covariance down when a variance has grown past the
        prior's (windup; see the module docstring). Scaling keeps it
        symmetric positive definite and its directions as they are."""
        largest = max(self._p[i][i] for i in range(_N))
        if largest > self._prior_variance:
            k = self._prior_variance / largest
            self._p = [[v * k for v in row] for row in self._p]

    def observe_plan(self, plan: StepPlan, seconds: float) -> None:
        """A measured ``runner.execute(plan)``: the predicted swap time is
        taken off and the rest fits the forward (plans without a forward
        teach only the swap cost)."""
        num_blocks = len(plan.swap_out) + len(plan.swap_in)
        if not plan.seqs:
            self.observe_swap(num_blocks, seconds)
            return
        self.observe(StepShape.of(plan), seconds - self.swap_seconds(num_blocks))

    def observe_swap(self, num_blocks: int, seconds: float) -> None:
        """A measured block copy; blends into the per-block cost (EWMA)."""
        if num_blocks > 0 and seconds > 0:
            sample = seconds / num_blocks
            self._swap_s_per_block = 0.9 * self._swap_s_per_block + 0.1 * sample
            self._refresh()

    # -- predictions -----------------------------------------------------

    def step_seconds(self, shape: StepShape) -> float:
        forward = self._forward_seconds(
            shape.num_prefill_tokens, shape.num_decode_seqs, shape.num_context_tokens
        )
        return max(_MIN_STEP_S, forward) + self.swap_seconds(shape.num_swapped_blocks)

    def _forward_seconds(self, prefill: int, decodes: int, context: int) -> float:
        """The clamped dot product of ``_features``, unrolled in the same
        order (so bit-identical), within ``MAX_DRIFT`` of the start-up
        prediction: the hot path of every estimate."""
        t0, t1, t2, t3, t4 = self._clamped
        s0, s1, s2, s3, s4 = _SCALES
        fit = t0 * (1.0 / s0) + t1 * (prefill / s1) + t2 * (decodes / s2) + t3 * (context / s3)
        if prefill:  # the fifth feature is 1 (a step holding a prefill), else 0
            fit += t4 * (1.0 / s4)
        if not self._may_drift_past:
            return fit
        u0, u1, u2, u3, u4 = self._start_theta
        start = u0 * (1.0 / s0) + u1 * (prefill / s1) + u2 * (decodes / s2) + u3 * (context / s3)
        if prefill:
            start += u4 * (1.0 / s4)
        return min(fit, self._max_drift * start)

    def plan_seconds(self, plan: StepPlan) -> float:
        """Predicted wall time of executing ``plan`` (swaps plus forward)."""
        if not plan.seqs:
            return self.swap_seconds(len(plan.swap_out) + len(plan.swap_in))
        return self.step_seconds(StepShape.of(plan))

    def idle_seconds(self) -> float:
        """A step's fixed cost: how far a simulator's clock moves when idle."""
        return max(_MIN_STEP_S, self.coefficients.base_s)

    def swap_seconds(self, num_blocks: int) -> float:
        return num_blocks * self._swap_s_per_block

    def prefill_seconds(self, num_tokens: int, token_budget: int, start: int = 0) -> float:
        """Prefilling positions ``[start, start + num_tokens)`` alone, in
        chunks of at most ``token_budget`` tokens (one step per chunk)."""
        if 0 < num_tokens <= token_budget:  # one chunk: every decode's estimate asks this
            return max(_MIN_STEP_S, self._forward_seconds(num_tokens, 0, start + num_tokens))
        total = 0.0
        pos, end = start, start + num_tokens
        while pos < end:
            n = min(token_budget, end - pos)
            total += max(_MIN_STEP_S, self._forward_seconds(n, 0, pos + n))
            pos += n
        return total

    def decode_seconds(self, context: int, num_tokens: int) -> float:
        """``num_tokens`` decode steps alone, starting at ``context`` tokens.
        Closed form: the context feature grows by one per step."""
        if num_tokens <= 0:
            return 0.0
        total = _decode_total(self.coefficients, context, num_tokens)
        if self._may_drift_past:
            start = _decode_total(self._start_coefficients, context, num_tokens)
            total = min(total, self._max_drift * start)
        return max(_MIN_STEP_S * num_tokens, total)

    def batched_seconds(self, prompt: int, output: int, batch: int) -> float:
        """A request's share of a full batch's time: its prompt tokens, its
        ``output - 1`` decodes (each with a ``1 / batch`` share of the step's
        fixed cost) and the context each of its steps reads. Under overload
        the batch stays full, so the machine time of a run is the sum of
        these: the work a request costs, where ``service_seconds`` is the
        time it takes."""
        decodes = max(0, output - 1)
        # Prefill reads the prompt once; decode k (1-based) reads prompt + k tokens.
        context = prompt + decodes * prompt + decodes * (decodes + 1) // 2
        return self.batched_step_seconds(StepShape(prompt, decodes, context), batch)

    def batched_step_seconds(self, shape: StepShape, batch: int) -> float:
        """The weight a step gets through: its tokens' shares of a full
        batch's time, each decode with a ``1 / batch`` share of the fixed
        cost (equal to the step's predicted time for a full batch of
        ``batch`` decodes). ``batched_seconds`` is a request's steps summed."""
        c = self.coefficients
        return (
            c.per_prefill_token_s * shape.num_prefill_tokens
            + (c.per_decode_seq_s + c.base_s / max(1, batch)) * shape.num_decode_seqs
            + c.per_context_token_s * shape.num_context_tokens
        )

    def service_seconds(
        self, num_computed: int, num_tokens: int, num_outputs_left: int, token_budget: int
    ) -> float:
        """A request's remaining time if it ran alone: finish the prefill of
        ``num_tokens - num_computed`` known tokens (its last chunk samples one
        output), then ``num_outputs_left - 1`` more decode steps."""
        prefill = self.prefill_seconds(num_tokens - num_computed, token_budget, num_computed)
        return prefill + self.decode_seconds(num_tokens, max(0, num_outputs_left - 1))


def fit_relative(
    samples: list[tuple[StepShape, float]], swap_s_per_block: float | None = None
) -> CostCoefficients:
    """The coefficients that best fit measured steps in *relative* error,
    none below zero: the start-up calibration's fit (non-negative least
    squares over ``(shape, seconds)``, each step weighted by ``1 / seconds``).

    Relative, because a deadline is spent in many small steps as much as in
    a few large ones: fitted in absolute seconds, a 25 ms prefill's 10 %
    outweighs a 0.6 ms decode's whole time, and the fixed cost of a step
    comes out wherever the large steps' noise puts it. Non-negative, because
    a coefficient fitted below zero and then clamped leaves the others fitted
    around it: an H200's calibration came out with no fixed cost at all and
    so predicted a request alone at a thirteenth of what it took, and every
    deadline set from it was as wrong. Exact: each set of coefficients left
    free is solved by least squares and the best fit with none negative
    wins (five features: 31 small solves). Swap cost is not a step feature
    (``swap_s_per_block``: kept, or the default)."""
    rows = [[f / seconds for f in _features(shape)] for shape, seconds in samples if seconds > 0]
    best: tuple[float, list[float]] | None = None
    for mask in range(1, 1 << _N):
        free = [i for i in range(_N) if mask >> i & 1]
        solved = _least_squares([[row[i] for i in free] for row in rows])
        if solved is None or min(solved) < 0.0:
            continue
        theta = [0.0] * _N
        for i, t in zip(free, solved, strict=True):
            theta[i] = t
        error = sum((1.0 - _dot(theta, row)) ** 2 for row in rows)
        if best is None or error < best[0]:
            best = (error, theta)
    swap = CostCoefficients().swap_s_per_block if swap_s_per_block is None else swap_s_per_block
    if best is None:  # no step measured: the built-in guess
        return replace(CostCoefficients(), swap_s_per_block=swap)
    return CostCoefficients.from_vector(best[1], swap)


def _dot(a: list[float], b: list[float]) -> float:
    return sum(x * y for x, y in zip(a, b, strict=True))


def _least_squares(rows: list[list[float]]) -> list[float] | None:
    """``argmin |A t - 1|`` over the rows of ``A`` (normal equations with a
    vanishing ridge, Gaussian elimination with partial pivoting); None when
    the rows cannot tell the columns apart."""
    n = len(rows[0]) if rows else 0
    if n == 0 or len(rows) < n:
        return None
    a = [[sum(r[i] * r[j] for r in rows) for j in range(n)] for i in range(n)]
    b = [sum(r[i] for r in rows) for i in range(n)]
    scale = max(a[i][i] for i in range(n))
    if scale <= 0.0:
        return None
    for i in range(n):
        a[i][i] += 1e-12 * scale
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(a[r][col]))
        if abs(a[pivot][col]) <= 1e-10 * scale:
            return None
        a[col], a[pivot] = a[pivot], a[col]
        b[col], b[pivot] = b[pivot], b[col]
        for r in range(col + 1, n):
            k = a[r][col] / a[col][col]
            for j in range(col, n):
                a[r][j] -= k * a[col][j]
            b[r] -= k * b[col]
    t = [0.0] * n
    for i in reversed(range(n)):
        t[i] = (b[i] - sum(a[i][j] * t[j] for j in range(i + 1, n))) / a[i][i]
    return t


def idle_keep(idle_s: float) -> float:
    """The share of a learned departure that ``idle_s`` of idle time keeps."""
    return math.pow(0.5, max(0.0, idle_s) / RELAX_HALF_LIFE_S)


def _decode_total(c: CostCoefficients, context: int, num_tokens: int) -> float:
    per_step = c.base_s + c.per_decode_seq_s + c.per_context_token_s * (context + 1)
    growth = c.per_context_token_s * num_tokens * (num_tokens - 1) / 2
    return per_step * num_tokens + growth


def _features(shape: StepShape) -> list[float]:
    prefill = shape.num_prefill_tokens
    raw = (1.0, prefill, shape.num_decode_seqs, shape.num_context_tokens, 1.0 if prefill else 0.0)
    return [v / s for v, s in zip(raw, _SCALES, strict=True)]


def recompute_beats_swap(model: CostModel, num_blocks: int, num_tokens: int, budget: int) -> bool:
    """True when re-prefilling ``num_tokens`` is cheaper than swapping
    ``num_blocks`` out and back in."""
    return model.prefill_seconds(num_tokens, budget) < model.swap_seconds(2 * num_blocks)
