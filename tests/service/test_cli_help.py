"""``--help`` is for users: every flag of the everyday commands says what it
does, and the defaults a newcomer asks about are shown."""

from __future__ import annotations

import argparse

import pytest

from slipstream.service.cli import build_parser, main


def _command(name: str) -> argparse.ArgumentParser:
    parser = build_parser()
    (commands,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return commands.choices[name]


def _help(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as exited:
        main([*argv, "--help"])
    assert exited.value.code == 0
    return capsys.readouterr().out


@pytest.mark.parametrize("command", ["serve", "generate", "chat", "stats"])
def test_every_flag_has_help(command: str) -> None:
    bare = [a.option_strings[0] for a in _command(command)._actions if not a.help]
    assert not bare


SERVE_DEFAULTS_SHOWN = """--host --port --model --policy --aging-s --grace-s --block-size
    --max-num-seqs --max-queue-len --kv-cache-gb --min-residency-s"""


@pytest.mark.parametrize(
    ("command", "flags"),
    [
        ("serve", SERVE_DEFAULTS_SHOWN.split()),
        ("generate", ["--model", "--max-tokens", "--temperature"]),
        ("chat", ["--server", "--max-tokens", "--temperature"]),
        ("stats", ["--timeout-s"]),
    ],
)
def test_defaults_are_shown(command: str, flags: list[str]) -> None:
    parser = _command(command)
    by_flag = {a.option_strings[0]: a for a in parser._actions if a.option_strings}
    formatter = parser._get_formatter()
    for flag in flags:
        action = by_flag[flag]
        shown = formatter._expand_help(action)
        assert f"default: {parser.get_default(action.dest)})" in shown, (flag, shown)


def test_the_top_level_help_is_user_text(capsys: pytest.CaptureFixture[str]) -> None:
    """It was the module docstring: '... registers itself through ``add_parser(subparsers)``'."""
    text = _help([], capsys)
    assert "``" not in text and "add_parser" not in text
    assert "gRPC and an OpenAI-compatible HTTP API" in text
    (serve,) = [line for line in text.splitlines() if line.strip().startswith("serve ")]
    assert "gRPC" in serve and "HTTP" in serve


def test_chat_help_says_how_to_reset_stop_and_quit(capsys: pytest.CaptureFixture[str]) -> None:
    text = " ".join(_help(["chat"], capsys).split())
    assert "/reset starts a new conversation" in text
    assert "Ctrl-C stops an answer" in text and "Ctrl-D" in text


def test_log_level_help_lists_every_level_it_takes(capsys: pytest.CaptureFixture[str]) -> None:
    from slipstream.service.telemetry.logs import LEVELS

    text = " ".join(_help(["serve"], capsys).split())
    assert f"--log-level LOG_LEVEL {', '.join(LEVELS[:-1])} or {LEVELS[-1]}" in text


def test_version_is_the_installed_package_s(capsys: pytest.CaptureFixture[str]) -> None:
    from importlib.metadata import version

    with pytest.raises(SystemExit) as exited:
        main(["--version"])
    assert exited.value.code == 0
    assert capsys.readouterr().out == f"slipstream {version('slipstream')}\n"


@pytest.mark.parametrize(
    ("argv", "usage"),
    [
        (["generate", "--server", "127.0.0.1:1", "--prompt", "hi"], "usage: slipstream generate "),
        (["stats", "--server", "127.0.0.1:1"], "usage: slipstream stats "),
        (["model", "path", "tiny"], "usage: slipstream model path "),
    ],
)
def test_an_unknown_flag_gets_the_usage_of_the_command_it_follows(
    argv: list[str], usage: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """It got the top-level usage, `slipstream [-h] {model,generate,...}`."""
    with pytest.raises(SystemExit) as exited:
        main([*argv, "--bogus"])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(usage)
    assert f"{usage.removeprefix('usage: ').strip()}: error: unrecognized arguments: --bogus" in err
