"""Scheduling policies by name (``SchedulerConfig.policy``, ``--policy``)."""

from __future__ import annotations

from .config import SchedulerConfig
from .cost_model import CostModel
from .deadline_policy import DeadlinePolicy
from .policy_base import FcfsPolicy, PriorityPolicy, SchedulingPolicy

POLICY_NAMES = (FcfsPolicy.name, PriorityPolicy.name, DeadlinePolicy.name)
DEFAULT_POLICY = DeadlinePolicy.name


def make_policy(
    name: str, config: SchedulerConfig, cost_model: CostModel | None = None
) -> SchedulingPolicy:
    """The policy registered under ``name``; ValueError lists the known ones.
    ``cost_model`` is used by the policies that estimate time (``deadline``)."""
    if name == FcfsPolicy.name:
        return FcfsPolicy()
    if name == PriorityPolicy.name:
        return PriorityPolicy()
    if name == DeadlinePolicy.name:
        return DeadlinePolicy(config, cost_model)
    known = ", ".join(sorted(POLICY_NAMES))
    raise ValueError(f"unknown scheduling policy {name!r} (known: {known})")
