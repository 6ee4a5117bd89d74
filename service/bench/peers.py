"""The engines Slipstream is measured against, behind one interface.

A ``Peer`` adds its flags to ``bench offline``, reads its settings from them
(only when ``--engines`` names it) and replays a workload into an
``EngineRun``. ``PEERS`` is the one registry: ``bench offline --engines``
chooses from it, and ``bench serve`` finds the peers that also serve over
HTTP (``ServedPeer``) in ``SERVED_PEERS``.

    peer        what runs                             where
    hf_static   transformers ``generate``, static     this process
    hf_cb       transformers continuous batching      this process
    vllm        vLLM's offline engine                 its own Python (vllm_peer)
    llamacpp    llama.cpp's ``llama-server``          its own process (llamacpp_peer)

A peer that fails in another process raises a ``PeerError``; ``failure_entry``
turns it into that engine's report entry, and the other engines' figures
stand.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from slipstream.service.bench import llamacpp_peer, vllm_peer
from slipstream.service.bench.peer_process import PeerError
from slipstream.service.bench.report import EngineRun
from slipstream.service.bench.workload import WorkloadRequest
from slipstream.service.engine.config import SWITCH_CHOICES, switch

if TYPE_CHECKING:
    from slipstream.service.bench.offline import OfflineOptions


class Peer(Protocol):
    """One engine of ``bench offline`` other than Slipstream."""

    name: str
    by_default: bool  # runs when ``--engines`` is not given

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        """This peer's flags of ``bench offline``."""

    def settings(self, args: argparse.Namespace, environ: Mapping[str, str]) -> object:
        """How this peer runs, from the flags; ``ValueError`` when it cannot run as asked."""

    def run(
        self, model_dir: str, workload: Sequence[WorkloadRequest], options: OfflineOptions
    ) -> EngineRun:
        """``workload``, every request at once, EOS ignored; its settings are
        ``options.peers[name]``."""

    def record(self, options: OfflineOptions) -> dict[str, object]:
        """The settings a failed run reports."""

    def summary(self, metrics: Mapping[str, Any]) -> str | None:
        """One line under the table, if this peer has something to add."""


class ServedPeer(Protocol):
    """A peer that also serves the model over OpenAI-compatible HTTP (``bench serve``)."""

    name: str

    def served(
        self, python: str, model_dir: str, served_name: str, dtype: str, num_threads: int,
        port: int, log_path: Path,
    ) -> AbstractContextManager[str]:  # fmt: skip
        """The server's base URL while it runs."""


def failure_entry(peer: Peer, exc: PeerError, options: OfflineOptions) -> dict[str, object]:
    """Tell the user why ``peer`` failed (with its last log lines) and return
    its report entry."""
    print(f"{peer.name} failed: {exc}", file=sys.stderr)
    for line in exc.log_tail:
        print(f"  | {line}", file=sys.stderr)
    record = peer.record(options) if peer.name in options.peers else {}
    return exc.report_entry(record)


class _InProcess:
    """The transformers peers: no settings of their own beyond flags, nothing
    to report on failure, nothing to add under the table."""

    by_default = True

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        pass

    def record(self, options: OfflineOptions) -> dict[str, object]:
        return {}

    def summary(self, metrics: Mapping[str, Any]) -> str | None:
        return None


class HfStatic(_InProcess):
    """transformers' ``generate`` on left-padded static batches."""

    name = "hf_static"

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        # The flags of both transformers peers, in one group.
        peers = parser.add_argument_group("peers")
        peers.add_argument("--hf-batch-size", type=int, default=16, help="static batch size")
        peers.add_argument(
            "--hf-cb-page-size", type=int, help="unset: 64 on the CPU, transformers' own on a GPU"
        )
        peers.add_argument(
            "--hf-cb-max-batch-tokens",
            type=int,
            help="unset: 512 on the CPU, transformers' own on a GPU",
        )
        peers.add_argument(
            "--hf-cb-cuda-graphs",
            default="auto",
            choices=SWITCH_CHOICES,
            help="transformers' CUDA graphs (auto: on a GPU)",
        )

    def settings(self, args: argparse.Namespace, environ: Mapping[str, str]) -> object:
        return args.hf_batch_size

    def run(
        self, model_dir: str, workload: Sequence[WorkloadRequest], options: OfflineOptions
    ) -> EngineRun:
        from slipstream.service.bench.hf_peers import run_hf_static

        batch_size = options.peers.get(self.name, 16)
        return run_hf_static(
            model_dir,
            workload,
            options.dtype,
            batch_size=batch_size,
            device=options.device,  # type: ignore[arg-type]
        )


class HfContinuous(_InProcess):
    """transformers' own continuous batching (``ContinuousBatchingManager``)."""

    name = "hf_cb"

    def settings(self, args: argparse.Namespace, environ: Mapping[str, str]) -> object:
        from slipstream.service.bench.hf_peers import CBSettings

        return CBSettings(
            page_size=args.hf_cb_page_size,
            max_batch_tokens=args.hf_cb_max_batch_tokens,
            use_cuda_graph=switch(args.hf_cb_cuda_graphs),
        )

    def run(
        self, model_dir: str, workload: Sequence[WorkloadRequest], options: OfflineOptions
    ) -> EngineRun:
        from slipstream.service.bench.hf_peers import run_hf_cb

        return run_hf_cb(
            model_dir,
            workload,
            options.dtype,
            options.peers.get(self.name),
            options.device,  # type: ignore[arg-type]
        )


class _OwnProcess:
    """A peer in a process of its own, its flags, settings and failure
    record in its module (``add_arguments``, ``settings_from_args``,
    ``settings_record``)."""

    name: str
    module: Any
    by_default = False  # needs an environment or a binary of its own

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        self.module.add_arguments(parser)

    def settings(self, args: argparse.Namespace, environ: Mapping[str, str]) -> object:
        return self.module.settings_from_args(args, environ)

    def record(self, options: OfflineOptions) -> dict[str, object]:
        return self.module.settings_record(options.peers[self.name])  # type: ignore[no-any-return]

    def summary(self, metrics: Mapping[str, Any]) -> str | None:
        return None


class Vllm(_OwnProcess):
    """vLLM's CPU build, in its own Python environment (``vllm_peer``); its
    OpenAI server for ``bench serve`` (``vllm_server``)."""

    name = vllm_peer.ENGINE
    module = vllm_peer

    def run(
        self, model_dir: str, workload: Sequence[WorkloadRequest], options: OfflineOptions
    ) -> EngineRun:
        return vllm_peer.run_vllm(model_dir, workload, options.peers[self.name])  # type: ignore[arg-type]

    def summary(self, metrics: Mapping[str, Any]) -> str | None:
        return vllm_peer.summary_line(metrics)

    def served(
        self, python: str, model_dir: str, served_name: str, dtype: str, num_threads: int,
        port: int, log_path: Path,
    ) -> AbstractContextManager[str]:  # fmt: skip
        from slipstream.service.bench.vllm_server import vllm_server

        return vllm_server(python, model_dir, served_name, dtype, num_threads, port, log_path)


class LlamaCpp(_OwnProcess):
    """llama.cpp's ``llama-server`` on the model's original GGUF (``llamacpp_peer``)."""

    name = llamacpp_peer.ENGINE
    module = llamacpp_peer

    def run(
        self, model_dir: str, workload: Sequence[WorkloadRequest], options: OfflineOptions
    ) -> EngineRun:
        """llama.cpp serves the model's original GGUF: built-in GGUF models only."""
        from slipstream.service.models.store import GGUF_MODELS, find_packaged_gguf

        if options.model not in GGUF_MODELS:
            raise llamacpp_peer.LlamaServerError(
                f"llama.cpp runs GGUF files; model {options.model!r} has none "
                f"(built-in GGUF models: {', '.join(sorted(GGUF_MODELS))})"
            )
        gguf = find_packaged_gguf(options.model)
        return llamacpp_peer.run_llamacpp(gguf, workload, options.peers[self.name])  # type: ignore[arg-type]


_VLLM = Vllm()
PEERS: dict[str, Peer] = {p.name: p for p in (HfStatic(), HfContinuous(), _VLLM, LlamaCpp())}
SERVED_PEERS: dict[str, ServedPeer] = {_VLLM.name: _VLLM}
