"""One request type from the front door in: the scheduler's ``Request`` carries
the caller's frozen ``RequestSpec`` and takes every field they share from it by
name, so a field added to both reaches the scheduler with no copying code."""

from __future__ import annotations

import dataclasses

import pytest

from slipstream.scheduler.request import Request, RequestSpec, SamplingParams


def test_the_scheduler_request_takes_the_shared_fields_from_the_spec() -> None:
    spec = RequestSpec(
        req_id="s/1",
        prompt_token_ids=[5, 6, 7],
        max_new_tokens=9,
        sampling=SamplingParams(temperature=0.7, top_k=5, top_p=0.9, seed=3),
        stop_sequences=("END",),
        ignore_eos=True,
        priority=2,
        deadline=12.5,
        expected_output_tokens=8,
        arrival_time=None,
        first_token_deadline=11.0,
        tenant="search",
    )
    req = Request.from_spec(spec, eos_token_ids=(0,), arrival_time=10.0)
    assert req.spec is spec
    shared = {f.name for f in dataclasses.fields(RequestSpec)} & {
        f.name for f in dataclasses.fields(Request)
    }
    assert shared == {
        "req_id", "prompt_token_ids", "max_new_tokens", "sampling", "ignore_eos",
        "priority", "deadline", "expected_output_tokens", "arrival_time",
        "first_token_deadline",
    }  # fmt: skip
    for name in shared - {"arrival_time"}:
        assert getattr(req, name) == getattr(spec, name), name
    assert (req.arrival_time, req.eos_token_ids) == (10.0, (0,))
    # The scheduler's state is its own: appending output never touches the spec.
    req.prompt_token_ids.append(8)
    assert spec.prompt_token_ids == [5, 6, 7]


def test_the_spec_is_frozen() -> None:
    spec = RequestSpec(req_id="a", prompt_token_ids=[1], max_new_tokens=1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.priority = 0  # type: ignore[misc]
