"""Users' type checkers see the client's annotations: the package ships
``py.typed``, and ``generate``'s keyword arguments are typed."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

import slipstream.clients
import slipstream.v1

ROOT = Path(__file__).resolve().parents[2]

USER_CODE = """
from slipstream.clients import AsyncClient, Client


def main(client: Client) -> None:
    client.generate("Hello", max_tokens=8, deadline_s=2.0, stop="END", priority=1)
    client.generate("Hello", max_token=8)
    client.generate_one("Hello", max_tokens="8")


async def amain(client: AsyncClient) -> None:
    await client.chat([("user", "Hi")], deadline_s="2")
"""


def test_the_client_package_ships_its_py_typed_marker() -> None:
    """Without it mypy skips an installed client: "missing library stubs or
    py.typed marker"."""
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    package_data = pyproject["tool"]["setuptools"]["package-data"]
    assert "py.typed" in package_data["slipstream.clients"]
    assert (Path(slipstream.clients.__file__).parent / "py.typed").is_file()


def test_mypy_catches_a_misspelled_or_mistyped_option(tmp_path: Path) -> None:
    """``**options: object`` let ``max_token=8`` and ``max_tokens="8"``
    through, to fail only when run."""
    pytest.importorskip("mypy")
    # The two packages as an install lays them out, wherever these came from.
    package = tmp_path / "lib" / "slipstream"
    package.mkdir(parents=True)
    (package / "clients").symlink_to(Path(slipstream.clients.__file__).parent)
    (package / "v1").symlink_to(Path(slipstream.v1.__file__).parent)
    user = tmp_path / "user.py"
    user.write_text(USER_CODE)
    command = [sys.executable, "-m", "mypy", "--strict", "--no-incremental"]
    command += ["--follow-imports=silent", "--cache-dir", str(tmp_path / "cache"), "user.py"]
    env = {"MYPYPATH": str(tmp_path / "lib"), "PATH": ""}
    out = subprocess.run(command, capture_output=True, text=True, env=env, cwd=tmp_path).stdout
    # Only the user's lines: the generated stubs have findings of their own.
    lines = [line.split(":") for line in out.splitlines() if line.startswith("user.py:")]
    assert [int(line[1]) for line in lines if line[2] == " error"] == [7, 8, 12], out


def test_the_typed_options_are_generate_options_fields() -> None:
    from dataclasses import fields

    from slipstream.clients.wire import GenerateOptions, Options

    assert list(Options.__annotations__) == [f.name for f in fields(GenerateOptions)]
