"""A local fleet: N ``slipstream serve`` replicas on loopback ports behind
HAProxy, which picks a replica per request (per HTTP/2 stream).

    python ops/fleet/fleet.py up --replicas 3 --model tiny --port 50050
    slipstream generate --server 127.0.0.1:50050 --per-request --prompt Hello
    python ops/fleet/fleet.py down

    client ──h2c──▶ HAProxy :PORT ──h2c, one backend per request──▶ replica i :grpc_i
                          │
                          └── GET /ready every 500 ms ──▶ replica i :metrics_i
                              (200 SERVING / 503 loading or draining)

``up`` writes ``haproxy.cfg`` and ``fleet.json`` (pids, ports) in ``--dir`` and
returns once HAProxy sees every replica up; ``down`` stops HAProxy and sends
every replica SIGTERM (each drains: running requests finish). The ``Fleet``
class does the same for tests.

HAProxy comes from Debian's ``haproxy`` package (``make fleet-test`` installs
it when missing).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path

DEFAULT_DIR = Path(os.environ.get("TMPDIR", "/tmp")) / "slipstream-fleet"
HEALTH_INTERVAL_MS = 500

HAPROXY_CONFIG = """\
# Written by ops/fleet/fleet.py. gRPC is HTTP/2 end to end (cleartext, h2c):
# each client stream is one request, balanced on its own.
global
    maxconn 4096
    stats socket {dir}/haproxy.sock mode 600 level admin

defaults
    mode http
    timeout connect 2s
    # Long generations stream for minutes; a request is bounded by its deadline.
    timeout client 10m
    timeout server 10m
    timeout check 2s
    # A replica that refuses a connection (killed, restarting): try another.
    retries 2
    option redispatch 1
    retry-on conn-failure empty-response

frontend grpc
    bind 127.0.0.1:{port} proto h2
    default_backend replicas

backend replicas
    balance roundrobin
    http-reuse always
    # Health: the replica's /ready (its metrics port), 503 while loading or
    # draining; one failure takes it out, two successes bring it back.
    # (HTTP/1.1 to that port: the check would otherwise speak the servers' h2.)
    option httpchk
    http-check connect proto h1
    http-check send meth GET uri /ready
    http-check expect status 200
    default-server proto h2 check inter {interval}ms fall 1 rise 2
{servers}
"""


@dataclass
class Replica:
    index: int
    pid: int
    grpc_port: int
    metrics_port: int

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"


@dataclass
class FleetState:
    port: int
    haproxy_pid: int
    replicas: list[Replica] = field(default_factory=list)


def haproxy_config(port: int, replicas: list[Replica], directory: Path) -> str:
    servers = "\n".join(
        f"    server r{r.index} 127.0.0.1:{r.grpc_port} port {r.metrics_port}" for r in replicas
    )
    return HAPROXY_CONFIG.format(
        dir=directory, port=port, interval=HEALTH_INTERVAL_MS, servers=servers
    )


class Fleet:
    """Replicas and HAProxy as child processes of this one."""

    def __init__(
        self,
        num_replicas: int,
        port: int,
        model: str = "tiny",
        directory: Path = DEFAULT_DIR,
        serve_args: tuple[str, ...] = (),
    ) -> None:
        if num_replicas < 1:
            raise ValueError("a fleet needs at least one replica")
        self.num_replicas = num_replicas
        self.port = port
        self.model = model
        self.directory = directory
        self.serve_args = serve_args
        self.procs: dict[int, subprocess.Popen[str]] = {}
        self.replicas: list[Replica] = []
        self.haproxy: subprocess.Popen[bytes] | None = None

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 300.0) -> None:
        haproxy = shutil.which("haproxy")
        if haproxy is None:
            raise RuntimeError("haproxy is not installed (apt-get install -y haproxy)")
        self.directory.mkdir(parents=True, exist_ok=True)
        try:
            for i in range(self.num_replicas):
                self._spawn(i)
            self.replicas = [self._wait_listening(i, timeout_s) for i in range(self.num_replicas)]
            config = self.directory / "haproxy.cfg"
            config.write_text(haproxy_config(self.port, self.replicas, self.directory))
            subprocess.run([haproxy, "-c", "-q", "-f", str(config)], check=True)
            with open(self.directory / "haproxy.log", "w") as log:
                self.haproxy = subprocess.Popen(
                    [haproxy, "-db", "-f", str(config)],
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            self.wait_up(range(self.num_replicas), timeout_s)
        except BaseException:
            self.stop()
            raise
        self._write_state()

    def _spawn(self, index: int) -> None:
        command = [sys.executable, "-m", "slipstream.service.cli", "serve", "--port", "0"]
        # No HTTP front (its default port, 8000, would be every replica's): the
        # fleet is gRPC behind HAProxy; --serve-arg=--http-port=N overrides it.
        command += ["--metrics-port", "0", "--http-port", "0", "--model", self.model]
        command += self.serve_args
        # Files, not pipes: the replicas outlive `fleet.py up`.
        with (
            open(self.directory / f"replica-{index}.out", "w") as out,
            open(self.directory / f"replica-{index}.log", "w") as log,
        ):
            self.procs[index] = subprocess.Popen(
                command,
                stdout=out,
                stderr=log,
                text=True,
                start_new_session=True,  # a Ctrl-C to the caller is not a SIGINT to each
            )

    def _wait_listening(self, index: int, timeout_s: float) -> Replica:
        """The ports replica ``index`` printed once it listens."""
        proc, out = self.procs[index], self.directory / f"replica-{index}.out"
        deadline = time.monotonic() + timeout_s
        while True:
            text = out.read_text()
            grpc_port = re.search(r"listening on \S+:(\d+)", text)
            metrics_port = re.search(r"metrics on http://\S+:(\d+)/", text)
            if grpc_port and metrics_port:
                return Replica(index, proc.pid, int(grpc_port.group(1)), int(metrics_port.group(1)))
            if proc.poll() is not None:
                raise RuntimeError(
                    f"replica {index} exited with {proc.returncode}; see "
                    f"{self.directory}/replica-{index}.log"
                )
            if time.monotonic() > deadline:
                raise TimeoutError(f"replica {index} did not start in {timeout_s:.0f} s")
            time.sleep(0.2)

    # -- what HAProxy sees ------------------------------------------------

    def server_states(self) -> dict[str, str]:
        """``{"r0": "UP", ...}`` from HAProxy's stats socket."""
        reply = self._admin("show stat")
        states = {}
        for line in reply.splitlines():
            fields = line.split(",")
            if len(fields) > 17 and fields[0] == "replicas" and fields[1].startswith("r"):
                states[fields[1]] = fields[17].split()[0]
        return states

    def wait_up(self, indices: range | list[int], timeout_s: float = 60.0) -> None:
        names = {f"r{i}" for i in indices}
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                states = self.server_states()
            except OSError:
                states = {}
            if all(states.get(name) == "UP" for name in names):
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"HAProxy does not see {sorted(names)} up: {states}")
            time.sleep(0.1)

    def _admin(self, command: str) -> str:
        import socket

        with socket.socket(socket.AF_UNIX) as sock:
            sock.settimeout(5)
            sock.connect(str(self.directory / "haproxy.sock"))
            sock.sendall(command.encode() + b"\n")
            chunks = []
            while chunk := sock.recv(65536):
                chunks.append(chunk)
        return b"".join(chunks).decode()

    def finished_requests(self, index: int) -> float:
        """Requests replica ``index`` has finished (all reasons), from its /metrics."""
        url = f"http://127.0.0.1:{self.replicas[index].metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=10) as response:
            text = response.read().decode()
        return sum(
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith("slipstream_requests_finished_total{")
        )

    # -- failures and stopping --------------------------------------------

    def kill(self, index: int) -> None:
        """SIGKILL: the replica vanishes mid-request."""
        self.procs[index].kill()
        self.procs[index].wait()

    def drain(self, index: int) -> None:
        """SIGTERM: the replica reports NOT_SERVING and finishes what it runs."""
        self.procs[index].send_signal(signal.SIGTERM)

    def stop(self) -> None:
        if self.haproxy is not None and self.haproxy.poll() is None:
            self.haproxy.terminate()
            self.haproxy.wait(timeout=10)
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs.values():
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        (self.directory / "fleet.json").unlink(missing_ok=True)

    def _write_state(self) -> None:
        assert self.haproxy is not None
        state = FleetState(self.port, self.haproxy.pid, self.replicas)
        (self.directory / "fleet.json").write_text(json.dumps(asdict(state), indent=2))

    def __enter__(self) -> Fleet:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


# ---------------------------------------------------------------- command line


def _up(args: argparse.Namespace) -> int:
    fleet = Fleet(args.replicas, args.port, args.model, args.dir, tuple(args.serve_arg))
    fleet.start()
    # Detach: the processes outlive this command; `down` stops them by pid.
    print(f"fleet: {args.replicas} replicas behind HAProxy on {fleet.target}")
    for replica in fleet.replicas:
        print(f"  r{replica.index}: grpc {replica.target}, metrics :{replica.metrics_port}")
    return 0


def _down(args: argparse.Namespace) -> int:
    path = args.dir / "fleet.json"
    if not path.exists():
        print(f"fleet: nothing running ({path} is absent)")
        return 0
    state = json.loads(path.read_text())
    pids = [state["haproxy_pid"]] + [r["pid"] for r in state["replicas"]]
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + 60
    while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    for pid in filter(_alive, pids):
        os.kill(pid, signal.SIGKILL)
    path.unlink()
    print("fleet: stopped")
    return 0


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    up = commands.add_parser("up", help="start replicas and HAProxy")
    up.add_argument("--replicas", type=int, default=3)
    up.add_argument("--port", type=int, default=50050, help="HAProxy's port")
    up.add_argument("--model", default="tiny")
    up.add_argument(
        "--serve-arg", action="append", default=[], help="extra `slipstream serve` argument"
    )
    up.add_argument("--dir", type=Path, default=DEFAULT_DIR)
    up.set_defaults(func=_up)
    down = commands.add_parser("down", help="stop what `up` started")
    down.add_argument("--dir", type=Path, default=DEFAULT_DIR)
    down.set_defaults(func=_down)
    args = parser.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
