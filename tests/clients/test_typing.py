"""Users' type checkers see the client's annotations: the package ships
``py.typed``, and ``generate``'s keyword arguments are typed."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path
from types import ModuleType

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
    client.generate("Hello", presence_penalty=0.5, repetition_penalty=1.2, logit_bias={7: -100})
    client.generate("Hello", logit_bias={"7": -100})


async def amain(client: AsyncClient) -> None:
    await client.chat([("user", "Hi")], deadline_s="2")
"""


@pytest.mark.parametrize("package", [slipstream.clients, slipstream.v1], ids=lambda p: p.__name__)
def test_each_typed_package_ships_its_py_typed_marker(package: ModuleType) -> None:
    """Without it mypy skips an installed package: "missing library stubs or
    py.typed marker" (so it did for ``slipstream.v1``, the stubs' types)."""
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    package_data = pyproject["tool"]["setuptools"]["package-data"]
    assert "py.typed" in package_data[package.__name__]
    assert (Path(package.__file__ or "").parent / "py.typed").is_file()


def test_mypy_reads_the_stubs_types_from_an_install(tmp_path: Path) -> None:
    """An install's packages sit in site-packages, where mypy reads only those
    that carry ``py.typed`` (MYPYPATH, below, reads any)."""
    pytest.importorskip("mypy")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    where = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    site = subprocess.run(
        [venv / "bin/python", "-c", where], capture_output=True, text=True, check=True
    ).stdout.strip()
    package = Path(site) / "slipstream"
    package.mkdir()
    (package / "clients").symlink_to(Path(slipstream.clients.__file__).parent)
    (package / "v1").symlink_to(Path(slipstream.v1.__file__ or "").parent)
    user = tmp_path / "user.py"
    user.write_text(
        "from slipstream.clients import Client\n"
        "from slipstream.v1 import inference_pb2 as pb\n\n\n"
        "def name(client: Client) -> pb.ModelInfo:\n"
        "    return client.model_info()\n"
    )
    command = [sys.executable, "-m", "mypy", "--strict", "--no-incremental"]
    command += ["--python-executable", str(venv / "bin/python")]
    command += ["--follow-imports=silent", "--cache-dir", str(tmp_path / "cache"), "user.py"]
    done = subprocess.run(command, capture_output=True, text=True, env={"PATH": ""}, cwd=tmp_path)
    assert "user.py:" not in done.stdout, done.stdout
    assert done.returncode == 0, done.stdout + done.stderr


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
    assert [int(line[1]) for line in lines if line[2] == " error"] == [7, 8, 10, 14], out


def test_the_typed_options_are_generate_options_fields() -> None:
    from dataclasses import fields

    from slipstream.clients.wire import GenerateOptions, Options

    assert list(Options.__annotations__) == [f.name for f in fields(GenerateOptions)]
