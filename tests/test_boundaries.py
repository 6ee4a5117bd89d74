"""Architecture boundaries (DESIGN.md): the scheduler imports no torch and no
grpc, and nothing below the service imports the service."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

_BLOCK_AND_IMPORT = """
import importlib, pkgutil, sys

BLOCKED = ("torch", "grpc")

class Blocker:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ImportError(f"{name} is blocked by the boundary test")
        return None

sys.meta_path.insert(0, Blocker())
import slipstream.scheduler as pkg

names = [m.name for m in pkgutil.iter_modules(pkg.__path__, "slipstream.scheduler.")]
for name in names:
    importlib.import_module(name)
leaked = sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED)
assert not leaked, leaked
print(len(names))
"""


def test_scheduler_imports_without_torch_or_grpc() -> None:
    result = subprocess.run(
        [sys.executable, "-c", _BLOCK_AND_IMPORT],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    num_modules = int(result.stdout.strip())
    expected = {p.stem for p in (ROOT / "scheduler").glob("*.py")} - {"__init__"}
    assert num_modules == len(expected)


def test_the_blocker_really_blocks() -> None:
    # Guards the test above: with the same finder, importing torch must fail.
    code = _BLOCK_AND_IMPORT.replace("import slipstream.scheduler as pkg", "import torch")
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode != 0 and "blocked by the boundary test" in result.stderr


def _imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def _imports_service(path: Path) -> bool:
    return any(
        name == "slipstream.service" or name.startswith("slipstream.service.")
        for name in _imported_modules(path)
    )


def test_lower_layers_never_import_the_service() -> None:
    offenders = [
        str(path.relative_to(ROOT))
        for folder in ("clients", "scheduler", "kernels")
        for path in sorted((ROOT / folder).rglob("*.py"))
        if _imports_service(path)
    ]
    assert not offenders, offenders


def test_service_import_detection_sees_every_spelling(tmp_path: Path) -> None:
    spellings = [
        "import slipstream.service",
        "import slipstream.service.engine.engine as e",
        "from slipstream import service",
        "from slipstream.service.engine.engine import Engine",
    ]
    for index, line in enumerate(spellings):
        path = tmp_path / f"m{index}.py"
        path.write_text(line + "\n", encoding="utf-8")
        assert _imports_service(path), line
    clean = tmp_path / "clean.py"
    clean.write_text("from slipstream.scheduler import Scheduler\n", encoding="utf-8")
    assert not _imports_service(clean)


# What each room of service/ must not reach (DESIGN.md; each room's __init__ says so).
_ROOM_BLOCKS = {
    "engine": ("grpc", "slipstream.v1", "slipstream.service.api", "slipstream.service.telemetry"),
    "models": (
        "grpc",
        "slipstream.v1",
        "slipstream.service.engine",
        "slipstream.service.api",
        "slipstream.service.telemetry",
    ),
    "api": (
        "torch",
        "transformers",
        "slipstream.kernels",
        "slipstream.service.models",
        "slipstream.service.engine.engine",
        "slipstream.service.engine.runner",
    ),
    "telemetry": (
        "torch",
        "transformers",
        "slipstream.kernels",
        "slipstream.service.models",
        "slipstream.v1",
        "slipstream.service.api",
    ),
}

_ROOM_IMPORT = """
import importlib, pkgutil, sys

BLOCKED = {blocked!r}

def blocked(name):
    return any(name == b or name.startswith(b + ".") for b in BLOCKED)

class Blocker:
    def find_spec(self, name, path=None, target=None):
        if blocked(name):
            raise ImportError(f"{{name}} is blocked by the boundary test")
        return None

sys.meta_path.insert(0, Blocker())
import slipstream.service.{room} as pkg

names = [m.name for m in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + ".")]
for name in names:
    importlib.import_module(name)
leaked = sorted(m for m in sys.modules if blocked(m))
assert not leaked, leaked
print(len(names))
"""


@pytest.mark.parametrize("room", sorted(_ROOM_BLOCKS))
def test_each_room_imports_without_what_it_must_not_reach(room: str) -> None:
    code = _ROOM_IMPORT.format(blocked=_ROOM_BLOCKS[room], room=room)
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert int(result.stdout.strip()) == len(_modules_below(ROOT / "service" / room))


def _modules_below(package: Path) -> list[Path]:
    """Every module and sub-package (such as api/http/) below ``package``."""
    found = []
    for path in package.glob("*.py"):
        if path.stem != "__init__":
            found.append(path)
    for sub in package.iterdir():
        if (sub / "__init__.py").exists():
            found += [sub, *_modules_below(sub)]
    return found


def test_the_room_blocker_really_blocks() -> None:
    code = _ROOM_IMPORT.format(blocked=("slipstream.service.engine.engine",), room="engine")
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode != 0 and "blocked by the boundary test" in result.stderr
