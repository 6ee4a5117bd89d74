"""A client-only install (no ``slipstream[server]``): a command whose module
cannot be imported still parses, whatever follows it, and says what to
install, naming the command as the user typed it."""

from __future__ import annotations

import importlib

import pytest

import slipstream.service.cli as cli
from slipstream.service.cli.bench import BENCH_MODULES

NEEDS_TORCH = {"slipstream.service.cli.kernels", *BENCH_MODULES}


@pytest.fixture
def client_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """The modules that import torch fail as they do without it."""
    real_import = importlib.import_module

    def import_module(name: str, package: str | None = None) -> object:
        if name in NEEDS_TORCH:
            raise ModuleNotFoundError("No module named 'torch'", name="torch")
        return real_import(name, package)

    monkeypatch.setattr(importlib, "import_module", import_module)
    monkeypatch.setattr(cli, "missing_server_modules", lambda: ["torch"])


@pytest.mark.parametrize(
    ("argv", "command"),
    [
        (["bench", "step"], "bench step"),
        (["bench", "step", "--model", "tiny"], "bench step"),
        (
            ["bench", "serve", "--server", "127.0.0.1:1", "--no-local", "--requests", "2"],
            "bench serve",
        ),
        (["bench", "kv-accuracy", "tiny"], "bench kv-accuracy"),
        (["kernels", "--help"], "kernels"),
        (["kernels", "build"], "kernels"),
    ],
)
def test_a_command_without_the_server_extra_says_what_to_install(
    client_only: None, argv: list[str], command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        cli.main(argv)
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert (
        f"slipstream: error: `slipstream {command}` needs the server extra (torch missing)" in err
    )
    assert "pip install torch==2.13.0 && pip install '.[server]'" in err


def test_the_bench_list_names_commands_as_a_full_install_does(
    client_only: None, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        cli.main(["bench", "--help"])
    out = capsys.readouterr().out
    assert "kv-accuracy" in out and "kv_accuracy" not in out


def test_an_unknown_flag_of_an_installed_command_is_still_refused(
    client_only: None, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        cli.main(["stats", "--server", "127.0.0.1:1", "--bogus"])
    assert exited.value.code == 2
    assert "slipstream stats: error: unrecognized arguments: --bogus" in capsys.readouterr().err
