"""The fake's ``SamplingParams`` and ``RequestOutputKind`` (see ``__init__``)."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class RequestOutputKind(Enum):
    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    ignore_eos: bool = False
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
