"""Scheduler configuration: one frozen dataclass, built once at the entry point."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """Limits the scheduler plans within.

    ``num_device_blocks`` and ``num_host_blocks`` size the two KV block pools
    (``block_size`` tokens per block); ``max_num_batched_tokens`` is the
    per-step token budget shared by decodes and prefill chunks;
    ``max_num_seqs`` bounds the running batch; ``max_queue_len`` bounds the
    waiting queue (admission answers QueueFull beyond it). ``policy`` names a
    policy registered in ``slipstream.scheduler.policy_registry``.

    Knobs of the ``deadline`` policy: ``reject_infeasible`` turns on early
    rejection (DeadlineInfeasible) of a request that would miss its deadline
    even running alone from its arrival; ``aging_s`` promotes a request by one
    priority class per that many seconds in the system (0 disables aging);
    ``abandon_hopeless`` ends work the policy judges unable to make its
    deadline at the current load (DEADLINE_EXCEEDED) before it expires;
    ``min_residency_s`` protects a request just admitted or resumed from
    being pushed out for waiting work (the thrash guard);
    ``shed_under_overload`` refuses, while more work arrives than the engine
    serves, arrivals of classes above 0, the least urgent class and the
    heaviest first (Overloaded; ``overload.py``).

    ``num_speculative_tokens``: up to that many draft tokens a decode may
    carry, proposed by prompt lookup (``speculative.py``) and verified in
    the same step; 0 turns speculative decoding off.

    ``enable_prefix_cache``: full KV blocks are kept and shared by hash of
    their prefix (``block_manager.py``); an admitted request skips the
    prefill of every leading block already cached. Off by default here
    (the simulator's synthetic prompts are one token repeated, so every
    request would share everything); the engine turns it on.
    """

    num_device_blocks: int
    block_size: int
    max_model_len: int
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 512
    num_host_blocks: int = 0
    max_queue_len: int = 4096
    policy: str = "deadline"
    reject_infeasible: bool = True
    abandon_hopeless: bool = True
    aging_s: float = 60.0
    min_residency_s: float = 0.05
    enable_prefix_cache: bool = False
    shed_under_overload: bool = True
    num_speculative_tokens: int = 0

    def __post_init__(self) -> None:
        positive = {
            "num_device_blocks": self.num_device_blocks,
            "block_size": self.block_size,
            "max_model_len": self.max_model_len,
            "max_num_seqs": self.max_num_seqs,
            "max_num_batched_tokens": self.max_num_batched_tokens,
            "max_queue_len": self.max_queue_len,
        }
        for name, value in positive.items():
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if not (self.aging_s >= 0 and self.min_residency_s >= 0):  # NaN included
            raise ValueError("aging_s and min_residency_s must be >= 0")
        if self.num_speculative_tokens < 0:
            raise ValueError(
                f"num_speculative_tokens must be >= 0, got {self.num_speculative_tokens}"
            )
        if self.num_host_blocks < 0:
            raise ValueError(f"num_host_blocks must be >= 0, got {self.num_host_blocks}")
