"""Verifying draft tokens (speculative decoding by prompt lookup): which of a
sequence's drafts the model accepts, and the token it adds after them.

A drafting sequence ran as one query ``[last, d1 .. dk]``, so the step has
``k + 1`` rows of logits for it: row ``i`` is the model's next token after
``d_i`` (row 0: after ``last``). Verification walks the rows in order: row
``i`` either accepts ``d_(i+1)`` and goes on, or picks the token that
replaces it and stops; a row past the last draft (all accepted) picks one
token of its own. A sequence thus gets 1 to ``k + 1`` tokens, each
distributed as the model's own sampling would draw it.

Greedy rows accept a draft when it is the row's argmax, and otherwise take
the argmax: exactly the tokens of one decode at a time.
"""

from __future__ import annotations

from collections.abc import Sequence


def accept_greedy(picks: Sequence[int], drafts: Sequence[Sequence[int]]) -> list[list[int]]:
    """Each sequence's verified tokens from its rows' greedy ``picks``
    (``len(d) + 1`` a sequence, concatenated in order): the picks up to and
    including the first that differs from its draft (all of them where
    every draft was picked)."""
    verified = []
    row = 0
    for seq_drafts in drafts:
        num_drafts = len(seq_drafts)
        rows = picks[row : row + num_drafts + 1]
        if len(rows) != num_drafts + 1:
            raise ValueError(f"{len(picks)} picks for drafts of {[len(d) for d in drafts]}")
        accepted = 0
        while accepted < num_drafts and rows[accepted] == seq_drafts[accepted]:
            accepted += 1
        verified.append(list(rows[: accepted + 1]))
        row += num_drafts + 1
    if row != len(picks):
        raise ValueError(f"{len(picks)} picks for drafts of {[len(d) for d in drafts]}")
    return verified
