"""Build hook: the wheel and the sdist-built wheel carry generated gRPC stubs.

Stubs are generated from ``protos/`` by ``protos/generate.py`` at build time
(``grpcio-tools`` is a build requirement, pinned so the stubs' protobuf and
grpcio version checks match the runtime pins in pyproject.toml). They are not
committed: one source of truth, nothing to go stale. Everything else about the
package is in pyproject.toml.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent


def _generate_stubs(out_dir: Path) -> None:
    spec = importlib.util.spec_from_file_location("_slipstream_protos", ROOT / "protos/generate.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.generate(ROOT / "protos", out_dir)


class BuildPyWithStubs(build_py):
    """``build_py``, then the stubs written into the build tree's ``slipstream/v1``."""

    def run(self) -> None:
        super().run()
        if not self.editable_mode:  # an editable install reads the stubs `make protos` writes
            _generate_stubs(Path(self.build_lib))


setup(cmdclass={"build_py": BuildPyWithStubs})
