"""Log-probabilities of sampled tokens, for the requests that ask for them.

They are the model's own distribution over the vocabulary at that position,
``log_softmax`` of the raw logits, before temperature, top-k or top-p shape
the draw (as OpenAI's and vLLM's default): a token's log-probability says how
likely the model found it, whatever drew it. The alternatives are that
distribution's most likely tokens, most likely first.

Split as the sampler is (``device_sampling``): ``log_probs`` and
``pick_logprobs`` are tensor math on any device with nothing that
synchronises, so a GPU step reads the results with its sampled ids; the
host turns them into lists afterwards.
"""

from __future__ import annotations

import torch


def log_probs(logits: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``log_softmax`` in float32 of ``logits[rows]`` (``[R, vocab]``): taken
    before sampling, which may scale the logits in place."""
    return torch.log_softmax(logits.index_select(0, rows).float(), dim=-1)


def pick_logprobs(
    log_p: torch.Tensor, token_ids: torch.Tensor, num_top: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per row of ``log_p`` (``[R, vocab]``): the log-probability of its
    ``token_ids`` entry (``[R]``), and the ``num_top`` highest log-probabilities
    with their token ids (``[R, num_top]``, descending)."""
    chosen = log_p.gather(1, token_ids.view(-1, 1).long()).view(-1)
    top_values, top_ids = torch.topk(log_p, num_top, dim=-1)  # num_top 0: empty
    return chosen, top_values, top_ids
