"""The engine: one thread owns the model and the KV pools and runs the step loop

    plan = scheduler.schedule(now)     # pure Python: who runs, who waits
    result = runner.execute(plan)      # swaps, then one forward over a ragged batch
    outputs = scheduler.update(plan, result.sampled, now)
    publish(outputs)                   # callbacks, on this thread

Callers on other threads ``submit`` (validated synchronously, under the lock
that guards the scheduler) and ``abort`` (queued, applied before the next
step, so an abort takes effect within one step).
"""

from __future__ import annotations

import json
import queue
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import structlog
import torch
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from slipstream.kernels import fused_ops, linear
from slipstream.kernels.backend import resolve_backend
from slipstream.kernels.cpu_features import CpuFeatures, DtypeChoice, choose_dtype, detect
from slipstream.scheduler.config import SchedulerConfig
from slipstream.scheduler.cost_model import CostCoefficients, CostModel
from slipstream.scheduler.errors import Draining
from slipstream.scheduler.plan import FinishedRequest, RequestOutput, StepPlan
from slipstream.scheduler.policies import DEFAULT_POLICY
from slipstream.scheduler.request import FinishReason, Request
from slipstream.scheduler.scheduler import Scheduler
from slipstream.service.engine.calibration import calibrate_cached
from slipstream.service.engine.chat import has_chat_template
from slipstream.service.engine.config import EngineConfig
from slipstream.service.engine.detokenizer import IncrementalDetokenizer
from slipstream.service.engine.events import (
    EngineStats,
    Event,
    EventCallback,
    FinishEvent,
    GenerationRequest,
    ModelInfo,
    PoolStats,
    PrefixCacheStats,
    TokenEvent,
)
from slipstream.service.engine.observer import EngineObserver
from slipstream.service.engine.runner import ModelRunner, kv_bytes_per_block
from slipstream.service.models.llama import LlamaModel
from slipstream.service.models.store import resolve_model, slipstream_home

log = structlog.get_logger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass(slots=True)
class _Live:
    """Engine-side state of one request: how to reach its caller and its text."""

    request: GenerationRequest
    state: Request  # the scheduler's record, read (never written) here
    on_event: EventCallback
    detokenizer: IncrementalDetokenizer


@dataclass(frozen=True, slots=True)
class FinishedResult:
    """A whole request's outcome, for in-process callers (``generate``)."""

    req_id: str
    token_ids: list[int]
    text: str
    finish: FinishEvent
    token_times: list[float] = field(default_factory=list)


def _eos_token_ids(model_dir: Path, fallback: tuple[int, ...]) -> list[int]:
    gen_config = model_dir / "generation_config.json"
    if gen_config.exists():
        eos = json.loads(gen_config.read_text()).get("eos_token_id")
        if eos is not None:
            return list(eos) if isinstance(eos, list) else [eos]
    return list(fallback)


def _model_and_kernels(config: EngineConfig) -> tuple[Path, str, bool, bool]:
    """The checkpoint directory, the attention backend and whether the fused
    step kernels and the panel projections load. On a first start all of them
    can be slow and none needs another (a GGUF conversion in Python, C++
    builds in compiler processes, each under its own lock), so they overlap.
    A model that cannot be resolved is reported once the builds end; they are
    cached either way."""
    home = slipstream_home()
    with ThreadPoolExecutor(2, thread_name_prefix="slipstream-build") as pool:
        backend = pool.submit(
            resolve_backend, config.attention_backend, torch.device("cpu"), home=home
        )
        fused = pool.submit(fused_ops.is_available, home) if config.compile else None
        panels = pool.submit(linear.panels_available, home) if config.compile else None
        model_dir = resolve_model(config.model)
        return (
            model_dir,
            backend.result(),
            fused is not None and fused.result(),
            panels is not None and panels.result(),
        )


def _step_cost_identity(
    model_dir: Path,
    choice: DtypeChoice,
    backend: str,
    fused: bool,
    panels: bool,
    cpu: CpuFeatures,
) -> dict[str, object]:
    """What a step's time depends on besides the plan: the key of a cached
    calibration. Weight files are named with their size and mtime, so a
    checkpoint rewritten in place is measured again."""
    weights = sorted(
        (p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in model_dir.glob("*.safetensors")
    )
    return {
        "model": str(model_dir),
        "weights": weights,
        "dtype": choice.dtype,
        "weights_packed": choice.pack_weights,
        "attention_backend": backend,
        "compiled": fused,
        "panel_linears": panels,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "cpu": cpu.describe(),
    }


def validate(request: GenerationRequest) -> None:
    """Rejects parameters no policy could serve; raises ValueError."""
    sampling = request.sampling
    checks = (
        (not request.prompt_token_ids, "prompt is empty"),
        (request.max_new_tokens < 1, "max_new_tokens must be at least 1"),
        (sampling.temperature < 0, "temperature must be >= 0"),
        (not 0.0 < sampling.top_p <= 1.0, "top_p must be in (0, 1]"),
        (sampling.top_k < 0, "top_k must be >= 0"),
        (request.priority < 0, "priority must be >= 0"),
        (any(not s for s in request.stop_sequences), "stop sequences must be non-empty"),
    )
    for failed, message in checks:
        if failed:
            raise ValueError(message)


class Engine:
    def __init__(self, config: EngineConfig, cpu: CpuFeatures | None = None) -> None:
        """``cpu`` overrides the detected CPU features (tests force either answer)."""
        cpu = cpu or detect()
        choice = choose_dtype(config.dtype, cpu)
        log.info(
            "cpu_features",
            cpu=cpu.model_name,
            flags=",".join(cpu.flags),
            torch_capability=cpu.torch_capability,
            dtype=choice.dtype,
            requested_dtype=choice.requested,
            weights_packed=choice.pack_weights,
        )
        if choice.warning:
            log.warning("slow_dtype", dtype=choice.dtype, reason=choice.warning)
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.config = config
        model_dir, backend, fused, panels = _model_and_kernels(config)
        self.model = LlamaModel(
            model_dir,
            DTYPES[choice.dtype],
            backend,
            choice.pack_weights,
            fused=fused,
            panel_linears=panels,
        )
        self.tokenizer: PreTrainedTokenizerBase = AutoTokenizer.from_pretrained(model_dir)
        self._fast_tokenizer = self.tokenizer.backend_tokenizer
        model_cfg = self.model.config
        max_model_len = min(
            config.max_model_len or model_cfg.max_position_embeddings,
            model_cfg.max_position_embeddings,
        )
        num_device_blocks, num_host_blocks = self._pool_sizes(max_model_len)
        self.runner = ModelRunner(
            self.model,
            num_device_blocks,
            num_host_blocks,
            config.block_size,
            config.commit_kv_memory,
        )
        # The deadline policy estimates service times from measured step costs;
        # calibrate on the real runner while the pools are still empty.
        self.cost_model: CostModel | None = None
        if config.policy == DEFAULT_POLICY:
            self.cost_model = (
                calibrate_cached(
                    self.runner,
                    config.max_num_batched_tokens,
                    config.max_num_seqs,
                    slipstream_home() / "cache" / "calibration",
                    _step_cost_identity(model_dir, choice, backend, fused, panels, cpu),
                )
                if config.calibrate_cost_model
                else CostModel(CostCoefficients(), max_drift=None)  # a guess, not a calibration
            )
        self.scheduler = Scheduler(
            SchedulerConfig(
                num_device_blocks=num_device_blocks,
                block_size=config.block_size,
                max_model_len=max_model_len,
                max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=config.max_num_batched_tokens,
                num_host_blocks=num_host_blocks,
                max_queue_len=config.max_queue_len,
                policy=config.policy,
                reject_infeasible=config.reject_infeasible,
                abandon_hopeless=config.abandon_hopeless,
                shed_under_overload=config.shed_under_overload,
                aging_s=config.aging_s,
                min_residency_s=config.min_residency_s,
                enable_prefix_cache=config.prefix_cache,
            ),
            cost_model=self.cost_model,
        )
        self.eos_token_ids = _eos_token_ids(model_dir, model_cfg.eos_token_ids)
        self.info = ModelInfo(
            name=config.model,
            path=str(model_dir),
            architecture=model_cfg.model_type,
            max_model_len=max_model_len,
            vocab_size=model_cfg.vocab_size,
            dtype=choice.dtype,
            block_size=config.block_size,
            attention_backend=backend,
            eos_token_ids=self.eos_token_ids,
            kv_bytes_per_block=kv_bytes_per_block(self.model, config.block_size),
            requested_dtype=choice.requested,
            weights_packed=choice.pack_weights,
            has_chat_template=has_chat_template(self.tokenizer),
            cpu=cpu.describe(),
            compiled=fused,
        )
        self._lock = threading.Lock()
        self._wakeup = threading.Event()
        self._aborts: queue.SimpleQueue[tuple[str, FinishReason, str]] = queue.SimpleQueue()
        self._live: dict[str, _Live] = {}
        self._draining = False
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._idle = threading.Condition(self._lock)
        # Telemetry hook; set before start(). None: no call, no cost.
        self.observer: EngineObserver | None = None
        # Called on the engine thread with every step that ran and its measured
        # seconds (what the cost model refits from); keep them cheap.
        self.step_listeners: list[Callable[[StepPlan, float], None]] = []
        log.info(
            "engine_ready",
            model=str(model_dir),
            dtype=choice.dtype,
            device_blocks=num_device_blocks,
            host_blocks=num_host_blocks,
            block_size=config.block_size,
            max_model_len=max_model_len,
            attention_backend=backend,
            compiled=fused,
            panel_linears=self.model.panel_linears and choice.dtype == "float32",
            prefix_cache=config.prefix_cache,
            kv_memory="commit" if config.commit_kv_memory else "lazy",
        )

    def _pool_sizes(self, max_model_len: int) -> tuple[int, int]:
        cfg = self.config
        blocks_per_seq = -(-max_model_len // cfg.block_size)
        by_memory = int(cfg.kv_cache_memory_gb * 2**30) // kv_bytes_per_block(
            self.model, cfg.block_size
        )
        device = cfg.num_device_blocks or max(
            blocks_per_seq, min(by_memory, cfg.max_num_seqs * blocks_per_seq)
        )
        host = cfg.num_host_blocks if cfg.num_host_blocks is not None else device // 2
        return device, host

    # -- caller side (any thread) -----------------------------------------

    def start(self) -> None:
        with self._lock:
            if self._thread is not None:
                return
            self._thread = threading.Thread(
                target=self._loop, name="slipstream-engine", daemon=True
            )
            self._thread.start()

    def submit(self, request: GenerationRequest, on_event: EventCallback) -> None:
        validate(request)
        arrival = request.arrival_time if request.arrival_time is not None else time.monotonic()
        eos = () if request.ignore_eos else tuple(self.eos_token_ids)
        sched_request = Request(
            req_id=request.req_id,
            prompt_token_ids=list(request.prompt_token_ids),
            max_new_tokens=request.max_new_tokens,
            sampling=request.sampling,
            eos_token_ids=eos,
            ignore_eos=request.ignore_eos,
            priority=request.priority,
            arrival_time=arrival,
            deadline=request.deadline,
            first_token_deadline=request.first_token_deadline,
            expected_output_tokens=request.expected_output_tokens,
        )
        detokenizer = IncrementalDetokenizer(
            self._fast_tokenizer, request.prompt_token_ids, request.stop_sequences
        )
        with self._lock:
            if self._draining:
                raise Draining("the server is draining and takes no new requests")
            self.scheduler.add_request(sched_request)
            self._live[request.req_id] = _Live(request, sched_request, on_event, detokenizer)
            if self.observer is not None:
                self.observer.on_submit(request, sched_request)
        self._wakeup.set()

    def abort(
        self, req_id: str, reason: FinishReason = FinishReason.CANCELLED, message: str = ""
    ) -> None:
        self._aborts.put((req_id, reason, message))
        self._wakeup.set()

    def pause(self, req_ids: Iterable[str]) -> None:
        """Holds these requests out of the batch (their KV kept) until
        ``resume``: their caller cannot take more output yet. Unknown or
        finished ids are ignored; a deadline still ends a paused request."""
        with self._lock:
            for req_id in req_ids:
                self.scheduler.pause(req_id)

    def resume(self, req_ids: Iterable[str]) -> None:
        with self._lock:
            for req_id in req_ids:
                self.scheduler.resume(req_id)
        self._wakeup.set()

    def stats(self) -> EngineStats:
        with self._lock:
            s = self.scheduler
            return EngineStats(
                waiting=s.num_waiting,
                running=s.num_running,
                swapped=s.num_swapped,
                device_blocks=PoolStats(s.num_used_device_blocks, s.num_free_device_blocks),
                host_blocks=PoolStats(s.num_used_host_blocks, s.num_free_host_blocks),
                by_priority=s.counts_by_priority(),
                step=s.step,
                is_draining=self._draining,
                prefix_cache=PrefixCacheStats(
                    queried_tokens=s.num_prefix_queried_tokens,
                    hit_tokens=s.num_prefix_hit_tokens,
                    cached_blocks=s.num_cached_device_blocks,
                ),
                overload_refused=s.num_overload_refused,
            )

    def drain(self) -> None:
        with self._lock:
            self._draining = True

    def wait_idle(self, timeout: float | None = None) -> bool:
        with self._idle:
            return self._idle.wait_for(lambda: not self._live, timeout)

    def shutdown(self) -> None:
        with self._lock:
            live_ids = list(self._live)
        for req_id in live_ids:
            self.abort(req_id, FinishReason.CANCELLED, "engine shut down")
        self.wait_idle(timeout=5.0)
        self._stopping = True
        self._wakeup.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)

    def generate(self, requests: list[GenerationRequest]) -> list[FinishedResult]:
        """Runs ``requests`` concurrently and returns their results in order."""
        collectors = {r.req_id: _Collector() for r in requests}
        self.start()
        for r in requests:
            self.submit(r, collectors[r.req_id].on_event)
        return [collectors[r.req_id].wait(r.req_id) for r in requests]

    # -- engine thread -----------------------------------------------------

    def _loop(self) -> None:
        while not self._stopping:
            self._apply_aborts()
            with self._lock:
                has_work = self.scheduler.has_unfinished()
                s = self.scheduler
                is_all_paused = has_work and s.num_paused >= (
                    s.num_waiting + s.num_running + s.num_swapped
                )
            if not has_work or is_all_paused:
                # Paused work still gets a step now and then: its deadlines expire.
                idle_since = time.monotonic()
                self._wakeup.wait(timeout=0.05 if is_all_paused else 0.5)
                self._wakeup.clear()
                if not is_all_paused:
                    self._observe_idle(time.monotonic() - idle_since)
                    continue
            try:
                self._step()
            except Exception:  # a broken step must not take the server down
                log.exception("engine_step_failed")
                self._fail_all("internal error during a model step")

    def _observe_idle(self, idle_s: float) -> None:
        # A model that predicts every request infeasible idles the engine and
        # so gets no steps to correct it: idle time moves the policy's
        # estimates back toward the start-up calibration.
        with self._lock:
            if not self.scheduler.has_unfinished():
                self.scheduler.observe_idle(idle_s)

    def _step(self) -> None:
        with self._lock:
            started = time.monotonic()
            plan = self.scheduler.schedule(started)
        for finished in plan.finished:
            self._finish(finished.req_id, finished.reason, finished.message, finished)
        if not plan.seqs and not plan.swap_in and not plan.swap_out:
            self._observe(plan, [], started)
            time.sleep(0.001)  # nothing runnable this instant (e.g. waiting on blocks)
            return
        result = self.runner.execute(plan)
        with self._lock:
            outputs = self.scheduler.update(plan, result.sampled, time.monotonic())
        self._observe(plan, outputs, started)
        self._publish(plan, outputs)
        # The refit sees the whole step — planning, forward, update, publishing —
        # because step-to-step time is what deadlines are spent in: timing the
        # forward alone overstated capacity by about half on `small`.
        seconds = time.monotonic() - started
        if self.cost_model is not None:
            with self._lock:
                self.cost_model.observe_plan(plan, seconds)
        for listener in self.step_listeners:
            listener(plan, seconds)

    def _observe(self, plan: StepPlan, outputs: list[RequestOutput], started: float) -> None:
        # Before _publish, so an observer sees a request's last tokens before its finish.
        if self.observer is not None and (plan.seqs or plan.preempted_req_ids):
            self.observer.on_step(plan, outputs, started, time.monotonic())

    def _publish(self, plan: StepPlan, outputs: list[RequestOutput]) -> None:
        batch_size = len(plan.seqs)
        now = time.monotonic()
        for out in outputs:
            live = self._live.get(out.req_id)
            if live is None:
                continue
            text = "".join(live.detokenizer.add(t) for t in out.new_token_ids)
            if out.new_token_ids:
                live.on_event(
                    TokenEvent(
                        req_id=out.req_id,
                        token_ids=list(out.new_token_ids),
                        text=text,
                        index=live.state.num_output_tokens - len(out.new_token_ids),
                        step=plan.step,
                        batch_id=plan.step,
                        batch_size=batch_size,
                        queue_wait_s=_queue_wait(live.state, now),
                    )
                )
            if out.finish_reason is not None:
                self._finish(out.req_id, out.finish_reason, out.message)
            elif live.detokenizer.stopped:
                self._end(out.req_id, FinishReason.STOP_SEQUENCE)

    def _apply_aborts(self) -> None:
        while True:
            try:
                req_id, reason, message = self._aborts.get_nowait()
            except queue.Empty:
                return
            self._end(req_id, reason, message)

    def _fail_all(self, message: str) -> None:
        for req_id in list(self._live):
            self._end(req_id, FinishReason.ERROR, message)
            # A step that failed after update() may leave requests the scheduler
            # already let go of; their callers still get exactly one finish.
            self._finish(req_id, FinishReason.ERROR, message)

    def _end(self, req_id: str, reason: FinishReason, message: str = "") -> None:
        """Ends a request the scheduler still holds: frees its blocks, tells its
        caller. Unknown or already finished ids are ignored."""
        with self._lock:
            out = self.scheduler.abort_request(req_id, reason, message)
        if out is not None:
            self._finish(req_id, reason, message)

    def _finish(
        self,
        req_id: str,
        reason: FinishReason,
        message: str = "",
        detail: FinishedRequest | None = None,
    ) -> None:
        """Tells the caller; ``detail`` is the scheduler's record of a
        request it ended while planning or admitting (limits, causes)."""
        live = self._live.get(req_id)
        if live is None:
            return
        state = live.state
        now = time.monotonic()
        event = FinishEvent(
            req_id=req_id,
            reason=reason,
            message=message,
            num_prompt_tokens=state.num_prompt_tokens,
            num_output_tokens=state.num_output_tokens,
            num_cached_tokens=state.num_cached_tokens,
            queue_wait_s=_queue_wait(state, now),
            ttft_s=None
            if state.first_token_time is None
            else state.first_token_time - state.arrival_time,
            total_s=now - state.arrival_time,
            num_preemptions=state.num_preemptions,
            text=live.detokenizer.flush(),
            expired_limit=None if detail is None else detail.expired_limit,
            reject_cause=None if detail is None else detail.reject_cause,
            retry_after_s=None if detail is None else detail.retry_after_s,
        )
        with self._idle:
            del self._live[req_id]
            if not self._live:
                self._idle.notify_all()
        if self.observer is not None:
            self.observer.on_finish(event)
        live.on_event(event)


def _queue_wait(state: Request, now: float) -> float:
    """Time from arrival to first being scheduled (still growing while queued)."""
    started = state.first_scheduled_time
    return (now if started is None else started) - state.arrival_time


class _Collector:
    """Gathers one request's events for ``Engine.generate``."""

    def __init__(self) -> None:
        self.token_ids: list[int] = []
        self.text: list[str] = []
        self.token_times: list[float] = []
        self.finish: FinishEvent | None = None
        self._done = threading.Event()

    def on_event(self, event: Event) -> None:
        if isinstance(event, TokenEvent):
            self.token_ids.extend(event.token_ids)
            self.text.append(event.text)
            self.token_times.append(time.monotonic())
        else:
            self.text.append(event.text)
            self.finish = event
            self._done.set()

    def wait(self, req_id: str) -> FinishedResult:
        self._done.wait()
        assert self.finish is not None
        return FinishedResult(
            req_id, self.token_ids, "".join(self.text), self.finish, self.token_times
        )
