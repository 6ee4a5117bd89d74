"""Generate Python stubs (``*_pb2.py``, ``*_pb2_grpc.py``, ``*.pyi``) next to
every ``.proto`` under ``protos/``. The output is git-ignored and never edited
by hand; run this after changing a ``.proto`` (``make protos`` does).

The stubs import each other as ``slipstream.v1.*``, which is where the
package mapping installs ``protos/slipstream/v1``.
"""

from __future__ import annotations

import argparse
import sys
from importlib import resources
from pathlib import Path

from grpc_tools import protoc

PROTO_ROOT = Path(__file__).resolve().parent


def proto_files(root: Path) -> list[Path]:
    return sorted(root.rglob("*.proto"))


def generate(root: Path = PROTO_ROOT, out_dir: Path | None = None) -> list[Path]:
    """Compile every ``.proto`` under ``root`` into ``out_dir`` (default:
    next to the protos). Returns the proto files compiled."""
    out = out_dir or root
    out.mkdir(parents=True, exist_ok=True)
    files = proto_files(root)
    well_known = resources.files("grpc_tools") / "_proto"
    args = [
        "grpc_tools.protoc",
        f"--proto_path={root}",
        f"--proto_path={well_known}",
        f"--python_out={out}",
        f"--pyi_out={out}",
        f"--grpc_python_out={out}",
        *(str(f.relative_to(root)) for f in files),
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed on {[str(f) for f in files]}")
    return files


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=None, help="output folder (default: in place)")
    args = parser.parse_args(argv)
    files = generate(out_dir=args.out)
    print(f"generated stubs for {len(files)} proto file(s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
