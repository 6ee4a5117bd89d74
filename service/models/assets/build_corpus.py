"""Rebuild ``corpus.txt.xz``, the text the default models' tokenizers are trained on.

Not run at model-creation time: the compressed corpus is committed, so every
machine trains on identical bytes. Sources are all under the Python Software
Foundation License (permissive): the reference-manual topics bundled with
CPython (``pydoc_data.topics``), docstrings of the pure-Python standard library,
and CPython's own LICENSE text.

Usage: python service/models/assets/build_corpus.py
"""

from __future__ import annotations

import importlib
import inspect
import lzma
import sys
import sysconfig
import warnings
from pathlib import Path

OUT = Path(__file__).with_name("corpus.txt.xz")
MAX_DOCSTRING_CHARS = 700_000
# Modules with import-time side effects (opening windows, printing, GUI toolkits).
SKIP_PREFIXES = ("antigravity", "this", "idlelib", "tkinter", "turtle", "test", "__")


def topic_texts() -> list[str]:
    from pydoc_data.topics import topics

    return [topics[key] for key in sorted(topics)]


def docstrings() -> list[str]:
    texts: list[str] = []
    seen: set[str] = set()
    for name in sorted(sys.stdlib_module_names):
        if name.startswith(SKIP_PREFIXES):
            continue
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                module = importlib.import_module(name)
        except Exception:
            continue
        for doc in module_docs(module):
            if doc not in seen:
                seen.add(doc)
                texts.append(doc)
    return texts


def module_docs(module: object) -> list[str]:
    docs = [inspect.getdoc(module) or ""]
    for attr in sorted(vars(module)):
        if attr.startswith("_"):
            continue
        value = getattr(module, attr)
        if inspect.isclass(value) or inspect.isfunction(value):
            docs.append(inspect.getdoc(value) or "")
    return [doc for doc in docs if len(doc) >= 80]


def main() -> None:
    license_text = Path(sysconfig.get_paths()["stdlib"], "LICENSE.txt").read_text()
    parts = [license_text, *topic_texts()]
    total = 0
    for doc in docstrings():
        if total >= MAX_DOCSTRING_CHARS:
            break
        parts.append(doc)
        total += len(doc)
    text = "\n\n".join(part.strip() for part in parts) + "\n"
    OUT.write_bytes(lzma.compress(text.encode("utf-8"), preset=9 | lzma.PRESET_EXTREME))
    print(f"{OUT}: {len(text):,} chars, {OUT.stat().st_size:,} bytes compressed")


if __name__ == "__main__":
    main()
