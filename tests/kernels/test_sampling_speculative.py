"""Verifying draft tokens (kernels/sampling_speculative.py)."""

from __future__ import annotations

import pytest

from slipstream.kernels.sampling_speculative import accept_greedy


def test_greedy_rows_accept_drafts_up_to_the_first_the_model_did_not_pick() -> None:
    drafts = [[5, 6, 7], [1], [8, 9]]
    picks = [5, 6, 2, 0, 3, 4, 8, 9, 10]  # rows: 3 + 1, 1 + 1, 2 + 1
    assert accept_greedy(picks, drafts) == [[5, 6, 2], [3], [8, 9, 10]]


def test_picks_must_be_one_a_draft_and_one_more() -> None:
    with pytest.raises(ValueError):
        accept_greedy([1, 2], [[1, 2]])
    with pytest.raises(ValueError):
        accept_greedy([1, 2, 3, 4], [[1, 2]])
