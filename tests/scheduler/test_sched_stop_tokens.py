"""vLLM's ``stop_token_ids``, ``min_tokens`` and ``min_p`` in the scheduler:
a stop id ends its request in ``update`` as a stop (its text not decoded),
and neither it nor EOS ends one before ``min_tokens`` outputs (their
bounds: test_sched_scheduler.py, beside the other sampling fields')."""

from __future__ import annotations

import dataclasses

from sched_fakes import EOS, make_request

from slipstream.scheduler import (
    FinishReason,
    RequestStatus,
    SamplingParams,
    Scheduler,
    SchedulerConfig,
)

STOP = 9


def make_scheduler() -> Scheduler:
    return Scheduler(SchedulerConfig(num_device_blocks=64, block_size=4, max_model_len=256))


def sampled(sched: Scheduler, tokens: list[int], **sampling: object) -> list[object]:
    """Runs one request, ``max_new_tokens`` 10, EOS not ignored, through a step
    per token of ``tokens`` while it lives; its outputs' finish reasons, and
    the tokens the stop check was asked about."""
    req = dataclasses.replace(
        make_request("r", 2, 10, ignore_eos=False), sampling=SamplingParams(**sampling)
    )
    sched.add_request(req)
    asked: list[int] = []

    def is_stopped(req_id: str, token_id: int) -> bool:
        asked.append(token_id)
        return False

    reasons = []
    for i, token in enumerate(tokens):
        if req.status is RequestStatus.FINISHED:
            break
        plan = sched.schedule(float(i))
        [out] = sched.update(plan, {"r": token}, float(i), is_stopped=is_stopped)
        reasons.append(out.finish_reason)
    return [reasons, asked, req.output_token_ids]


def test_a_stop_token_id_ends_the_request_as_a_stop_without_being_decoded() -> None:
    sched = make_scheduler()
    reasons, asked, outputs = sampled(sched, [4, 5, STOP, 6], stop_token_ids=(3, STOP))
    assert reasons == [None, None, FinishReason.STOP_SEQUENCE]
    assert outputs == [4, 5, STOP]  # the token is the output's; its text is not
    assert asked == [4, 5]
    assert sched.num_used_device_blocks == 0 and not sched.has_unfinished()


def test_a_stop_token_id_on_the_last_allowed_token_is_the_stop() -> None:
    sched = make_scheduler()
    reasons, _, _ = sampled(sched, [4] * 9 + [STOP], stop_token_ids=(STOP,))
    assert reasons[-1] is FinishReason.STOP_SEQUENCE and len(reasons) == 10


def test_neither_eos_nor_a_stop_id_ends_a_request_before_min_tokens() -> None:
    """The sampler masks them; one that got past it ends nothing, and is
    decoded as any token is."""
    sched = make_scheduler()
    tokens = [EOS, STOP, EOS]
    reasons, asked, _ = sampled(sched, tokens, min_tokens=2, stop_token_ids=(STOP,))
    assert reasons == [None, None, FinishReason.EOS]
    assert asked == [EOS, STOP, EOS]
    sched = make_scheduler()
    reasons, _, _ = sampled(sched, [4, 4, STOP], min_tokens=2, stop_token_ids=(STOP,))
    assert reasons == [None, None, FinishReason.STOP_SEQUENCE]


def test_min_tokens_leaves_the_length_limit_alone() -> None:
    sched = make_scheduler()
    reasons, _, _ = sampled(sched, [4] * 12, min_tokens=10)
    assert reasons == [None] * 9 + [FinishReason.MAX_TOKENS]


def test_only_min_tokens_counts_as_a_logit_adjustment() -> None:
    """The runners ask it of every row: min-p is the sampler's, stop ids
    mask nothing without min_tokens."""
    assert SamplingParams(min_tokens=1).has_logit_adjustments
    assert not SamplingParams(min_p=0.5, stop_token_ids=(3,)).has_logit_adjustments
    # And the per-token stop decision reads one flag for the requests with neither.
    assert SamplingParams(min_tokens=1).has_token_stops
    assert SamplingParams(stop_token_ids=(3,)).has_token_stops
    assert not SamplingParams(min_p=0.5, logit_bias=((3, 1.0),)).has_token_stops
