"""Which optional parts of Slipstream are installed.

The base install is the client (``generate --server``, ``stats``); serving,
local generation, models and benchmarks need ``slipstream[server]``. A command
that needs it and lacks it says so in one line instead of an ImportError.
"""

from __future__ import annotations

import importlib.util

SERVER_EXTRA_MODULES = ("torch", "transformers", "structlog")
# From the source tree, as the README says: torch first, so that its CPU
# wheel (or the CUDA one you choose) is the one the extra finds.
INSTALL_HINT = "pip install torch==2.13.0 && pip install '.[server]' (in the source tree)"


def missing_server_modules() -> list[str]:
    return [name for name in SERVER_EXTRA_MODULES if importlib.util.find_spec(name) is None]


class ServerExtraMissing(Exception):
    """A command needs the server extra, which is not installed."""

    def __init__(self, command: str, missing: list[str]) -> None:
        super().__init__(
            f"`slipstream {command}` needs the server extra ({', '.join(missing)} missing): "
            f"{INSTALL_HINT}"
        )


def require_server_extra(command: str) -> None:
    """Raises ServerExtraMissing when the server extra's modules are absent."""
    missing = missing_server_modules()
    if missing:
        raise ServerExtraMissing(command, missing)
