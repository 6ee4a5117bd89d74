"""Slipstream's Llama-family forward pass over a ragged batch and a paged KV cache.

Covers Llama, Mistral and Qwen2-style checkpoints (bias on q/k/v, read when
the checkpoint has it). Mistral's sliding window is not applied: attention is
full, which is exact while a context stays within the window. Weights are
read from safetensors by their Hugging Face names and fused where one matmul
does the work of several:

    q_proj ┐                       gate_proj ┐
    k_proj ├─▶ qkv [(nq+2nkv)·d, h]  up_proj ├─▶ gate_up [2i, h]
    v_proj ┘

The forward takes one flat token tensor for the whole step (prefill chunks and
decodes of many sequences, no padding) and returns hidden states only for the
positions that will be sampled, so the vocabulary projection never runs on
the rest of a prompt.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors import safe_open

from slipstream.kernels import cpu_attention, fused_ops
from slipstream.kernels.attention import AttentionMetadata
from slipstream.kernels.backend import paged_attention_for, write_kv_for
from slipstream.kernels.linear import Linear

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")


class UnsupportedModel(ValueError):
    """The checkpoint's architecture or layout is not one Slipstream runs."""


@dataclass(frozen=True, slots=True)
class LlamaConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    eos_token_ids: tuple[int, ...]

    @classmethod
    def from_dir(cls, model_dir: Path) -> LlamaConfig:
        raw = json.loads((model_dir / "config.json").read_text())
        try:
            return cls._from_raw(raw)
        except KeyError as exc:
            raise UnsupportedModel(f"{model_dir / 'config.json'} has no {exc}") from None

    @classmethod
    def _from_raw(cls, raw: dict[str, Any]) -> LlamaConfig:
        model_type = raw.get("model_type", "")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedModel(
                f"model_type {model_type!r} is not supported (supported: {SUPPORTED_MODEL_TYPES})"
            )
        num_heads = raw["num_attention_heads"]
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        return cls(
            model_type=model_type,
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_layers=raw["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=raw.get("num_key_value_heads") or num_heads,
            head_dim=raw.get("head_dim") or raw["hidden_size"] // num_heads,
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            max_position_embeddings=raw.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            eos_token_ids=eos_ids,
        )


def rope_inv_freq(model_dir: Path) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and attention scaling of the checkpoint's RoPE
    variant, computed by transformers' own table so every scaling type
    (default, linear, dynamic-free llama3, yarn, ...) matches it exactly."""
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf_config = AutoConfig.from_pretrained(model_dir)
    params = getattr(hf_config, "rope_parameters", None) or {}
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        theta = params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
        dim = getattr(hf_config, "head_dim", None) or (
            hf_config.hidden_size // hf_config.num_attention_heads
        )
        inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
        return inv_freq, 1.0
    if rope_type == "dynamic":
        raise UnsupportedModel("dynamic RoPE scaling is not supported")
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config, torch.device("cpu"))
    return inv_freq, float(scaling)


class _Weights:
    """Reads tensors by Hugging Face name from one or many safetensors shards."""

    def __init__(self, model_dir: Path) -> None:
        index = model_dir / "model.safetensors.index.json"
        if index.exists():
            weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
            self._files = {name: model_dir / shard for name, shard in weight_map.items()}
        else:
            single = model_dir / "model.safetensors"
            if not single.exists():
                raise UnsupportedModel(f"no safetensors weights in {model_dir}")
            with safe_open(single, framework="pt") as f:
                self._files = {name: single for name in f.keys()}  # noqa: SIM118
        self._handles: dict[Path, object] = {}

    def has(self, name: str) -> bool:
        return name in self._files

    def get(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        path = self._files.get(name)
        if path is None:
            raise UnsupportedModel(f"checkpoint has no tensor {name!r}")
        if path not in self._handles:
            self._handles[path] = safe_open(path, framework="pt")
        handle = self._handles[path]
        return handle.get_tensor(name).to(dtype).contiguous()  # type: ignore[attr-defined]


@dataclass(frozen=True, slots=True)
class _Layer:
    input_norm: torch.Tensor
    qkv: Linear
    o_proj: Linear
    post_norm: torch.Tensor
    gate_up: Linear
    down: Linear


class LlamaModel:
    """Weights and the forward pass. Holds no per-request state: the KV cache
    belongs to the runner and is passed in."""

    def __init__(
        self,
        model_dir: Path,
        dtype: torch.dtype,
        attention_backend: str = "torch",
        pack_weights: bool = False,
        fused: bool = False,
        panel_linears: bool = False,
        kv_dtype: torch.dtype | None = None,
    ) -> None:
        """``pack_weights`` packs projections for oneDNN (only where the CPU
        can: see ``kernels/cpu_features.py``). ``fused`` runs the elementwise
        work between the projections in ``kernels.fused_ops`` (loaded by the
        caller); otherwise eager torch ops, the reference. ``panel_linears``
        runs float32 projections in the panel kernel (``kernels.linear``,
        loaded by the caller) instead of oneDNN. ``kv_dtype``: the KV cache's
        element type, ``dtype`` by default; ``torch.int8`` keeps quantized rows
        (``kernels/kv_layout.py``), which the torch and fused CPU attention read."""
        self.config = LlamaConfig.from_dir(model_dir)
        self.dtype = dtype
        self.kv_dtype = kv_dtype or dtype
        self.pack_weights = pack_weights
        self.fused = fused
        self.panel_linears = panel_linears
        self.attention_backend = attention_backend
        self._write_kv = write_kv_for(attention_backend)
        self._paged_attention = paged_attention_for(attention_backend)
        cfg = self.config
        weights = _Weights(model_dir)
        self.embed = weights.get("model.embed_tokens.weight", dtype)
        self.layers = [self._load_layer(weights, i) for i in range(cfg.num_layers)]
        self.norm = weights.get("model.norm.weight", dtype)
        tied = cfg.tie_word_embeddings or not weights.has("lm_head.weight")
        lm_head = self.embed if tied else weights.get("lm_head.weight", dtype)
        # float32 logits out of bf16 panels where they run (see _logits)
        self.lm_head = Linear(lm_head, pack=pack_weights, panels=panel_linears, float_out=True)
        inv_freq, scaling = rope_inv_freq(model_dir)
        positions = torch.arange(cfg.max_position_embeddings, dtype=torch.float)
        freqs = positions[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.rope_cos = (emb.cos() * scaling).to(dtype)
        # rotate_half(x) * sin == roll(x, d/2) * signed_sin, with the sign of
        # the first half folded into the table: two fewer ops per layer.
        sin = emb.sin() * scaling
        half = sin.shape[-1] // 2
        self.rope_signed_sin = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1).to(dtype)
        self.scale = cfg.head_dim**-0.5
        self._q_size = cfg.num_heads * cfg.head_dim
        self._kv_size = cfg.num_kv_heads * cfg.head_dim
        self._logits_buffer: torch.Tensor | None = None  # see _logits
        # The fused forward's layer loop as one native call (fused_ops'
        # decoder_layers_) where every op it makes is a CPU kernel; False
        # runs the same ops from Python (bench step's python-loop mode).
        self.native_layers = fused and attention_backend == "cpu"
        # The same fused stages as Triton kernels (kernels/triton_elementwise),
        # for a model on a GPU: set by the device runner.
        self.triton_elementwise = False
        # Where set, int64 [2]: the native loop adds its nanoseconds in
        # attention and in the projections (bench step's split).
        self.layer_part_ns: torch.Tensor | None = None
        self._native_weights: tuple[list[Any], ...] | None = None
        self._native_pool: tuple[object, list[torch.Tensor], list[torch.Tensor]] | None = None

    def _load_layer(self, weights: _Weights, i: int) -> _Layer:
        prefix = f"model.layers.{i}."
        attn = prefix + "self_attn."
        mlp = prefix + "mlp."
        get = weights.get
        qkv = torch.cat([get(attn + f"{p}_proj.weight", self.dtype) for p in "qkv"])
        bias = None
        if weights.has(attn + "q_proj.bias"):
            bias = torch.cat([get(attn + f"{p}_proj.bias", self.dtype) for p in "qkv"])
        gate_up = torch.cat([get(mlp + f"{p}_proj.weight", self.dtype) for p in ("gate", "up")])
        return _Layer(
            input_norm=get(prefix + "input_layernorm.weight", self.dtype),
            qkv=self._linear(qkv, bias),
            o_proj=self._linear(get(attn + "o_proj.weight", self.dtype)),
            post_norm=get(prefix + "post_attention_layernorm.weight", self.dtype),
            gate_up=self._linear(gate_up),
            down=self._linear(get(mlp + "down_proj.weight", self.dtype)),
        )

    def _linear(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> Linear:
        return Linear(weight, bias, pack=self.pack_weights, panels=self.panel_linears)

    def _rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), weight, self.config.rms_norm_eps)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
        """RoPE, neox layout: ``x * cos + rotate_half(x) * sin``."""
        return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
        sample_indices: torch.Tensor,
        greedy: bool = False,
    ) -> torch.Tensor:
        """Returns the logits ``[len(sample_indices), vocab]`` for the packed
        tokens ``input_ids`` at ``positions``, float32 (``_logits``).
        ``greedy`` (only where ``picks_greedy``): each sampled row's greedy
        token instead, int64."""
        if self.fused or self.triton_elementwise:
            return self._forward_fused(
                input_ids, positions, kv_caches, meta, sample_indices, greedy
            )
        cfg = self.config
        num_tokens = input_ids.shape[0]
        cos = self.rope_cos[positions].unsqueeze(1)
        signed_sin = self.rope_signed_sin[positions].unsqueeze(1)
        num_qk_heads = cfg.num_heads + cfg.num_kv_heads
        x = F.embedding(input_ids, self.embed)
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches, strict=True):
            h = self._rms_norm(x, layer.input_norm)
            qkv = layer.qkv(h)
            qk = qkv[:, : self._q_size + self._kv_size].view(num_tokens, num_qk_heads, cfg.head_dim)
            q, k = self._rotate(qk, cos, signed_sin).split([cfg.num_heads, cfg.num_kv_heads], dim=1)
            v = qkv[:, self._q_size + self._kv_size :].view(
                num_tokens, cfg.num_kv_heads, cfg.head_dim
            )
            self._write_kv(k_cache, v_cache, k, v, meta)
            attn = self._paged_attention(q, k_cache, v_cache, meta, self.scale)
            x = x + layer.o_proj(attn.reshape(num_tokens, self._q_size))
            h = self._rms_norm(x, layer.post_norm)
            gate, up = layer.gate_up(h).chunk(2, dim=-1)
            x = x + layer.down(F.silu(gate) * up)
        x = self._rms_norm(x[sample_indices], self.norm)
        return self.lm_head.argmax(x) if greedy else self._logits(x)

    def _forward_fused(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
        sample_indices: torch.Tensor,
        greedy: bool = False,
    ) -> torch.Tensor:
        """``forward`` with one fused kernel per elementwise stage: RoPE in
        place on the projection's output, the residual add folded into the
        next RMSNorm, SiLU and multiply in one pass (the CPU's ``fused_ops``,
        or on a GPU their Triton twins)."""
        ops = self.fused_elementwise_ops()
        eps = self.config.rms_norm_eps
        layers = self.layers
        x = F.embedding(input_ids, self.embed)  # the residual stream, updated in place
        if self.native_layers:
            self._native_layers(x, positions, kv_caches, meta)
            return self.sampled_logits(x, sample_indices, fused_ops, greedy)
        h = ops.rms_norm(x, layers[0].input_norm, eps)
        for i, (k_cache, v_cache) in zip(range(len(layers)), kv_caches, strict=True):
            q, k, v = self.attention_inputs(i, h, positions, ops)
            self._write_kv(k_cache, v_cache, k, v, meta)
            attn = self._paged_attention(q, k_cache, v_cache, meta, self.scale)
            h = self.after_attention(i, x, attn, ops)
        return self.sampled_logits(x, sample_indices, ops, greedy)

    @property
    def picks_greedy(self) -> bool:
        """Whether ``forward(..., greedy=True)`` can return greedy tokens: the
        LM head on bf16 panels takes each row's argmax without logits."""
        return self.lm_head.has_argmax

    def sampled_logits(
        self, x: torch.Tensor, sample_indices: torch.Tensor, ops: Any, greedy: bool = False
    ) -> torch.Tensor:
        """The fused forward's end: the final norm and the LM head over the
        rows ``sample_indices`` of the residual stream ``x`` (``greedy``: their
        greedy tokens, see ``forward``)."""
        rows = ops.rms_norm(x[sample_indices], self.norm, self.config.rms_norm_eps)
        return self.lm_head.argmax(rows) if greedy else self._logits(rows)

    def fused_elementwise_ops(self) -> Any:
        """The module of fused elementwise ops the fused forward calls."""
        if self.triton_elementwise:  # imported here: a CPU install may have no Triton
            from slipstream.kernels import triton_elementwise

            return triton_elementwise
        return fused_ops

    def attention_inputs(
        self, i: int, h: torch.Tensor, positions: torch.Tensor, ops: Any
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Layer ``i`` of the fused forward up to its attention: q, k, v
        ``[tokens, heads, head_dim]`` of the normed stream ``h``, RoPE applied."""
        cfg = self.config
        num_tokens = h.shape[0]
        qkv = self.layers[i].qkv(h)
        qk_size = self._q_size + self._kv_size
        qk = qkv[:, :qk_size].view(num_tokens, cfg.num_heads + cfg.num_kv_heads, cfg.head_dim)
        ops.rotary_neox_(qk, self.rope_cos, self.rope_signed_sin, positions)
        q, k = qk.split([cfg.num_heads, cfg.num_kv_heads], dim=1)
        v = qkv[:, qk_size:].view(num_tokens, cfg.num_kv_heads, cfg.head_dim)
        return q, k, v

    def after_attention(
        self, i: int, x: torch.Tensor, attn: torch.Tensor, ops: Any
    ) -> torch.Tensor:
        """Layer ``i`` of the fused forward after its attention: the output
        projection and the MLP added to the residual stream ``x`` in place.
        Returns layer ``i + 1``'s normed input (the last layer: ``x``)."""
        layers, eps = self.layers, self.config.rms_norm_eps
        o = layers[i].o_proj(attn.reshape(x.shape[0], self._q_size))
        h = ops.add_rms_norm_(x, o, layers[i].post_norm, eps)
        mlp = layers[i].down(ops.silu_and_mul(layers[i].gate_up(h)))
        if i + 1 < len(layers):
            return ops.add_rms_norm_(x, mlp, layers[i + 1].input_norm, eps)
        return x.add_(mlp)

    def _native_layers(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
    ) -> None:
        """The fused layer loop in one ``fused_ops.decoder_layers_`` call: the
        same kernels in the same order, x updated in place. The weights'
        lists are gathered once, the caches' head-major storages once per pool."""
        cfg = self.config
        if self._native_weights is None:
            self._native_weights = fused_ops.decoder_weights(self.layers)
        if self._native_pool is None or self._native_pool[0] is not kv_caches:
            k_storages, v_storages = cpu_attention.storages_of(kv_caches)
            self._native_pool = (kv_caches, k_storages, v_storages)
        _, k_storages, v_storages = self._native_pool
        # The attention op checks its inputs as well; this raises the same
        # ValueErrors the per-layer path raises, once a step.
        q = x.new_empty(x.shape[0], cfg.num_heads, cfg.head_dim)
        cpu_attention.check(q, k_storages[0], v_storages[0], meta)
        fused_ops.decoder_layers_(
            x,
            *self._native_weights,
            k_storages,
            v_storages,
            self.rope_cos,
            self.rope_signed_sin,
            positions,
            meta,
            (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim),
            self.scale,
            cfg.rms_norm_eps,
            self.layer_part_ns,
        )

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        """The logits of the sampled rows, float32. On the CPU the LM head on
        panels (a compiled engine's) writes them into a buffer kept from step
        to step, valid until the next ``forward``: a fresh one (50 MB for 256
        rows) is above glibc's largest mmap threshold, so it was mapped and
        its every page faulted in each step. A bf16 model's panels write their
        float32 sums there unrounded: bf16 logits are 1/8 apart near 20, and
        SmolLM2's first answer to "What is the capital of France?" was then a
        tie ("The" and "L", 0.045 apart in float32) that greedy decoding broke
        by token id, to "L'Étoile, la Marseillaise" (docs/kernels.md, "The
        logits in float32"). Off the panels (a bf16 model run eagerly or on a
        CPU without AVX512-BF16, or a call of more than 4 rows where AMX does
        oneDNN's arithmetic) oneDNN's bf16 logits are widened with the columns
        near each row's maximum re-scored in float32 (``Linear._near_max``):
        greedy decoding picks the float32 maximum there too. On a GPU a
        16-bit model's LM head writes float32 where torch's ``mm`` can
        (``Linear.float_mm``), else its logits are rounded and widened."""
        if x.device.type != "cpu":
            return self.lm_head(x).float()
        if not self.lm_head.uses_panels:
            return self.lm_head(x)
        rows, vocab = x.shape[0], self.lm_head.out_features
        buffer = self._logits_buffer
        if buffer is None or buffer.shape[0] < rows or buffer.shape[1] != vocab:
            buffer = self._logits_buffer = torch.empty(rows, vocab, dtype=torch.float32)
        return self.lm_head(x, out=buffer[:rows])
