"""Configuration: one frozen dataclass per layer. Environment variables and
command-line flags are read only at the entry point (``cli.py``)."""

from __future__ import annotations

from dataclasses import dataclass

from slipstream.scheduler.config import SchedulerConfig

# On an H200 a step of 256 prefill tokens beside the decodes took 1.9-4.5 ms
# through the per-layer graphs against 21-24 ms eagerly; on an H100 1.5-3.4 ms
# as one graph of the whole step (docs/gpu.md).
PREFILL_GRAPH_TOKENS = 2048

# The longest decode context a step with a prefill replays its whole-step
# graph with; past it, a graph per layer around eager attention
# (layer_graphs.py). The whole-step attention walks a context in one program
# a KV head (no split). Measured on an H200 (docs/gpu.md, "Where the whole
# step stops paying"), a 256-token chunk beside 8 / 64 / 256 decodes: the
# whole step is cheaper at 1,024 and 2,048 tokens of context at every batch,
# and at 4,096 still at 64 and 256 while at 8 the two meet (planned ahead
# 4.41 against 4.36 ms): past that the split decode kernel wins.
WHOLE_STEP_MAX_CONTEXT = 4096

# "auto" resolves per CPU (kernels/cpu_features.py): bf16 with native bf16, else fp32.
DTYPE_CHOICES = ("auto", "float32", "bfloat16")

# The KV cache's element type. "auto": the model's dtype; "int8": rows quantized
# per (token, kv head) with their scale (kernels/kv_layout.py), a quarter of
# float32's bytes, half of bfloat16's; on the CPU only.
KV_CACHE_DTYPE_CHOICES = ("auto", "int8")

# How the KV pools get their memory (EngineConfig.commit_kv_memory): "commit"
# backs them at start-up, "lazy" as each block is first written.
KV_MEMORY_CHOICES = ("commit", "lazy")

# An auto|on|off flag: None (decided where it applies, e.g. per device), True, False.
SWITCH_CHOICES = ("auto", "on", "off")
CPU_STEP_TOKENS = 512
GPU_STEP_TOKENS = 8192


def switch(value: str) -> bool | None:
    return {"auto": None, "on": True, "off": False}[value]


SPECULATIVE_ON_CUDA = (
    "--speculative-tokens runs on the CPU only (the CUDA runner samples one "
    "token a sequence); on CUDA leave it at 0"
)


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """How the engine loads its model and sizes its KV pools.

    ``model`` is a default model name (``tiny``, ``small``) or a path to a
    local Hugging Face checkpoint. ``num_device_blocks`` / ``num_host_blocks``
    of ``None`` are sized from memory.
    """

    model: str = "tiny"
    # "auto": bf16 where the CPU has native bf16 (AVX512-BF16/AMX), else fp32.
    dtype: str = "auto"
    kv_cache_dtype: str = "auto"  # KV_CACHE_DTYPE_CHOICES
    block_size: int = 32
    num_device_blocks: int | None = None
    num_host_blocks: int | None = None
    max_num_seqs: int = 256
    # Tokens one step may run; None: 512 on the CPU, 8192 on a GPU, where a
    # step that is not a graphed decode costs ~10 ms of kernel launches
    # whatever its size, so fewer, larger prefill steps pay (docs/gpu.md).
    max_num_batched_tokens: int | None = None
    max_model_len: int | None = None
    max_queue_len: int = 4096
    policy: str = "deadline"
    reject_infeasible: bool = True
    abandon_hopeless: bool = True
    shed_under_overload: bool = True
    aging_s: float = 60.0
    min_residency_s: float = 0.05
    # Time synthetic steps at start-up to seed the deadline policy's cost
    # model (seconds on `small`); otherwise it starts from built-in guesses and
    # converges online from measured steps. The CLI turns it on.
    calibrate_cost_model: bool = False
    attention_backend: str = "auto"
    # The step's elementwise work (RMSNorm + residual, RoPE, SiLU * mul) in
    # natively compiled fused kernels (kernels/fused_ops.py), built once and
    # cached under $SLIPSTREAM_HOME; False keeps eager torch ops, the
    # reference. A failed build falls back to eager with one log line.
    compile: bool = True
    num_threads: int | None = None
    kv_cache_memory_gb: float = 2.0
    # Back both KV pools with memory at start-up, so the process's memory
    # does not grow as blocks are first used (the prefix cache ends up using
    # every block); False maps them lazily: quick to start, for tests and tools.
    # The CLI turns it on.
    commit_kv_memory: bool = False
    # Automatic prefix caching: full KV blocks are shared between requests
    # with equal prefixes and kept, evictable, after use (scheduler/block_manager.py).
    prefix_cache: bool = True
    seed: int = 0
    # auto: the first CUDA device when torch sees one, else the CPU (device.py).
    device: str = "auto"
    # On CUDA: the share of the GPU's free memory (after the weights) the KV
    # pool, activations and graph pool may take; decode steps replay CUDA graphs.
    gpu_memory_fraction: float = 0.9
    cuda_graphs: bool = True
    # On CUDA, with cuda_graphs: a step with a prefill of up to this many
    # tokens replays one graph of the whole step (a graph per layer around its
    # eagerly launched attention when its decodes' contexts pass
    # WHOLE_STEP_MAX_CONTEXT; layer_graphs.py) instead of ~10 launches a layer;
    # 0: such steps run eagerly.
    prefill_graph_tokens: int = PREFILL_GRAPH_TOKENS
    # On a GPU, the elementwise stages between projections as one Triton
    # kernel each (kernels/triton_elementwise.py); False: eager torch ops.
    gpu_fused_elementwise: bool = True
    # Plan step N+1 while the device runs step N (engine.py); None: on a GPU
    # only (on the CPU the host and the "device" are the same cores).
    plan_ahead: bool | None = None
    # Speculative decoding by prompt lookup (scheduler/speculative.py): up to
    # this many draft tokens a decode carries, verified in its step; 0: off.
    # The CPU runner only.
    speculative_tokens: int = 0

    def check(self) -> None:
        """Raises ValueError for settings no engine runs together, before
        anything is loaded or listening (the device ``auto`` resolves to is
        checked where it is known)."""
        if self.speculative_tokens and self.plan_ahead:
            # A plan made ahead follows tokens still in flight: it has nothing
            # to look drafts up from, and every later plan is made ahead too.
            raise ValueError(
                "--speculative-tokens drafts from each step's results; with --plan-ahead on "
                "no step would draft (leave --plan-ahead at auto: off on the CPU)"
            )
        if self.speculative_tokens and self.device.startswith("cuda"):
            raise ValueError(SPECULATIVE_ON_CUDA)

    def step_token_budget(self, *, on_gpu: bool) -> int:
        """``max_num_batched_tokens``, or the device's default where unset."""
        if self.max_num_batched_tokens is not None:
            return self.max_num_batched_tokens
        return GPU_STEP_TOKENS if on_gpu else CPU_STEP_TOKENS

    def scheduler_config(
        self, num_device_blocks: int, num_host_blocks: int, max_model_len: int
    ) -> SchedulerConfig:
        """The scheduler's limits: this config's policy knobs, the pools as sized."""
        return SchedulerConfig(
            num_device_blocks=num_device_blocks,
            block_size=self.block_size,
            max_model_len=max_model_len,
            max_num_seqs=self.max_num_seqs,
            # load_parts sets the device's budget; unset here means the CPU's
            max_num_batched_tokens=self.step_token_budget(on_gpu=False),
            num_host_blocks=num_host_blocks,
            max_queue_len=self.max_queue_len,
            policy=self.policy,
            reject_infeasible=self.reject_infeasible,
            abandon_hopeless=self.abandon_hopeless,
            shed_under_overload=self.shed_under_overload,
            aging_s=self.aging_s,
            min_residency_s=self.min_residency_s,
            enable_prefix_cache=self.prefix_cache,
            num_speculative_tokens=self.speculative_tokens,
        )
