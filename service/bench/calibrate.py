"""``slipstream bench calibrate``: the engine's step-time model on this machine,
for the simulator (``bench slo --sim --calibration F``).

Two stages, as a serving engine learns it:

1. the start-up calibration (``service.engine.calibration.calibrate``):
   synthetic prefill and decode steps timed on the runner (forward only);
2. the online refit: a saturating batch of the SLO bench's length mix
   replayed through the real engine with the ``deadline`` policy, whose
   cost model is refit from every measured step — planning, forward,
   update and publishing, the time deadlines are really spent in.

The file holds the refit coefficients (``coefficients``, what the simulator
uses), the start-up ones for comparison, the engine shape they were
measured at and the CPU. The engine shape defaults to ``bench slo``'s
engine mode, so its twin and a ``--calibration`` simulation model the
same engine.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, replace
from pathlib import Path

from slipstream.scheduler.cost_model import CostCoefficients
from slipstream.service.bench.report import hardware, resolved_dtype
from slipstream.service.engine.config import DTYPE_CHOICES

FORMAT = "slipstream-calibration/1"


def add_parser(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    parser = subparsers.add_parser(
        "calibrate",
        help="measure the engine's step-time model into a JSON file",
        description=__doc__,
    )
    parser.add_argument("--model", default="small")
    parser.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES)
    parser.add_argument("--out", type=Path, required=True, help="JSON file to write")
    parser.add_argument("--max-num-seqs", type=int, default=32)
    parser.add_argument("--requests", type=int, default=96, help="refit batch (saturating)")
    parser.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    if args.requests < 1 or args.max_num_seqs < 1:
        raise SystemExit("--requests and --max-num-seqs must be >= 1")
    report = measure(args.model, resolved_dtype(args.dtype), args.max_num_seqs, args.requests)
    report["hardware"] = hardware(args.dtype)
    args.out.write_text(json.dumps(report, indent=2))
    c = report["coefficients"]
    assert isinstance(c, dict)
    print(
        f"wrote {args.out}: base {1000 * c['base_s']:.2f} ms, "
        f"{1e6 * c['per_prefill_token_s']:.1f} us/prefill token, "
        f"{1000 * c['per_prefill_step_s']:.2f} ms/step with a prefill, "
        f"{1000 * c['per_decode_seq_s']:.3f} ms/decode, "
        f"{1e9 * c['per_context_token_s']:.0f} ns/context token "
        f"({report['num_refit_steps']} measured steps, {report['capacity_rps']:.2f} req/s)"
    )
    return 0


def measure(model: str, dtype: str, max_num_seqs: int, num_requests: int) -> dict[str, object]:
    """Start-up calibration, then the online refit over a saturating batch."""
    from slipstream.service.bench.slo_engine import measure_capacity, start_engine
    from slipstream.service.bench.slo_options import SloOptions, engine_shaped

    opts = SloOptions(
        mode="engine",
        num_requests=num_requests,
        loads=(1.0,),
        cvs=(1.0,),
        policies=("deadline",),
        model=model,
        dtype=dtype,
        max_num_seqs=max_num_seqs,
    )
    # The engine shape of ``bench slo``'s engine mode.
    opts = replace(engine_shaped(opts), capacity_requests=num_requests)
    rig, startup = start_engine(opts, "deadline")
    try:
        started = time.monotonic()
        capacity = measure_capacity(opts, rig.engine)
        seconds = time.monotonic() - started
    finally:
        rig.engine.shutdown()
    refit = rig.cost_model
    return {
        "format": FORMAT,
        "model": model,
        "dtype": dtype,
        "coefficients": asdict(refit.coefficients),
        "startup_coefficients": asdict(startup.coefficients),
        "num_refit_steps": refit.num_samples,
        "refit_seconds": seconds,
        "capacity_rps": capacity.rps,
        "engine": {
            "max_num_seqs": opts.max_num_seqs,
            "max_num_batched_tokens": opts.max_num_batched_tokens,
            "block_size": opts.block_size,
            "num_device_blocks": opts.num_device_blocks,
            "num_host_blocks": opts.num_host_blocks,
        },
    }


def load_calibration(path: Path) -> CostCoefficients:
    """The step-time coefficients of a ``bench calibrate`` file (or of a bare
    ``{"base_s": ..., ...}`` object). ValueError names what is wrong."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"cannot read calibration {path}: {exc}") from exc
    if isinstance(data, dict) and "coefficients" in data:
        if data.get("format") != FORMAT:
            raise ValueError(f"{path}: not a {FORMAT} file (format {data.get('format')!r})")
        data = data["coefficients"]
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object of coefficients")
    known = set(CostCoefficients.__slots__)
    unknown = set(data) - known
    if unknown:
        raise ValueError(f"{path}: unknown coefficients {sorted(unknown)}")
    try:
        return CostCoefficients(**{k: float(v) for k, v in data.items()})
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{path}: bad coefficients: {exc}") from exc
