"""Attention metadata over staged device tensors, and the Triton attention
that reads it without building anything per layer or per step on the device.

``kernels.backend.triton_paged_attention`` derives its device tensors
(int32 lengths, decode/prefill row ids) from the metadata's Python lists
with ``torch.tensor(..., device=...)``: a pageable host-to-device copy that
waits for the GPU, once per step, and a new allocation a CUDA graph cannot
replay. Here they are views of the staging buffer's device twin
(``staging.py``), carried by ``StagedAttentionMetadata``; ``staged_paged_attention``
hands them to the same kernels.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from slipstream.kernels.attention import AttentionMetadata
from slipstream.kernels.backend import (
    TritonStep,
    triton_attention_for_step,
    triton_paged_attention,
)
from slipstream.kernels.workspace import default_workspace
from slipstream.service.engine.staging import StagedStep


@dataclass(frozen=True, slots=True)
class StagedAttentionMetadata(AttentionMetadata):
    """``AttentionMetadata`` whose backend-neutral tensors are staging views,
    plus the Triton step built from the same views. The torch path's fields
    (decode groups, prefill chunks) are empty: only the Triton kernels read it."""

    triton: TritonStep


def staged_metadata(
    step: StagedStep,
    views: dict[str, torch.Tensor],
    block_size: int,
    max_decode_len: int | None = None,
) -> StagedAttentionMetadata:
    """Metadata of a staged step over the device views (``StagingBuffers.device_views``).

    ``max_decode_len`` overrides the step's own bound: a CUDA graph is captured
    with the longest context it may ever replay, since the split count and
    tiles per split the decode kernel is launched with are frozen in the graph.
    """
    rows = step.num_rows
    device = views["token_ids"].device
    return StagedAttentionMetadata(
        query_lens=step.query_lens,
        seq_lens=step.seq_lens,
        seq_lens_t=views["seq_lens"][:rows],
        query_start_loc=views["query_start_loc"][: rows + 1],
        slot_mapping=views["slot_mapping"][: step.num_tokens],
        block_tables=views["block_tables"][:rows],
        block_size=block_size,
        num_tokens=step.num_tokens,
        decode_groups=[],
        prefill_chunks=[],
        is_single_decode_group=False,
        workspace=default_workspace(device),
        triton=TritonStep(
            seq_lens=views["seq_lens_i32"][:rows],
            decode_seq_ids=views["decode_seq_ids"][: step.num_decodes]
            if step.num_decodes
            else None,
            decode_token_ids=(
                views["decode_token_ids"][: step.num_decodes] if step.num_decodes else None
            ),
            max_decode_len=step.max_decode_len if max_decode_len is None else max_decode_len,
            prefill_seq_ids=(
                views["prefill_seq_ids"][: step.num_prefills] if step.num_prefills else None
            ),
            max_prefill_query_len=step.max_prefill_query_len,
        ),
    )


def staged_paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """``attention.paged_attention``'s contract through the Triton kernels; with
    staged metadata nothing is built, other metadata goes the usual way."""
    if not isinstance(meta, StagedAttentionMetadata):
        return triton_paged_attention(q, k_cache, v_cache, meta, scale)
    return triton_attention_for_step(q, k_cache, v_cache, meta, meta.triton, scale)
