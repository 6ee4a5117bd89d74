"""``slipstream bench kv-accuracy``: what the int8 KV cache costs in accuracy.

The model runs once with its own dtype's KV cache (the reference) and once
with int8 rows (``--kv-cache-dtype int8``, ``kernels/kv_layout.py``):

- greedy agreement: 12 prompts of everyday text, ``--new-tokens`` each, the
  engine's greedy tokens under both caches: how many prompts give identical
  tokens, and per prompt the tokens before the first difference;
- perplexity of a text (the project's README.md unless ``--text``), fed in
  chunks of ``--chunk`` tokens so every chunk reads the earlier ones' keys
  and values from the cache, as a long prompt does; and, over the same
  text, how often the most likely next token is the same under both caches
  (teacher-forced, so one difference does not carry into the next).

JSON out: ``{"model", hardware..., "kv_cache_dtype", "greedy": {"prompts",
"identical", "new_tokens", "first_difference": [...]}, "perplexity":
{"tokens", "chunk", "reference", "quantized", "ratio", "top1_agreement"}}``.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import sys
from pathlib import Path

from slipstream.service.bench.report import hardware, resolved_dtype
from slipstream.service.engine.config import DTYPE_CHOICES

PROMPTS = (
    "The capital of France is",
    "To make a cup of tea, first",
    "Photosynthesis is the process by which",
    "def fibonacci(n):\n    ",
    "The three primary colours are",
    "Once upon a time, in a small village by the sea,",
    "Water boils at 100 degrees Celsius because",
    "A good way to learn a new language is",
    "The main difference between a list and a tuple in Python is",
    "In 1969, the first humans to walk on the Moon",
    "Here is a short poem about autumn:\n",
    "The best advice I ever received was",
)
DEFAULT_TEXT = Path(__file__).resolve().parents[2] / "README.md"


def add_parser(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    parser = subparsers.add_parser(
        "kv-accuracy", help="greedy agreement and perplexity with an int8 KV cache"
    )
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--text", type=Path, default=DEFAULT_TEXT, help="perplexity text")
    parser.add_argument("--chunk", type=int, default=256, help="tokens per perplexity chunk")
    parser.add_argument("--max-tokens", type=int, default=2048, help="of the text, at most")
    parser.add_argument("--json", dest="json_path", default="kv-accuracy.json")
    parser.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    if not args.text.is_file():  # an installed wheel carries no README.md
        print(f"slipstream: error: no text at {args.text}; pass --text FILE", file=sys.stderr)
        return 2
    report = run(
        args.model,
        resolved_dtype(args.dtype),
        args.new_tokens,
        args.text.read_text(),
        args.chunk,
        args.max_tokens,
    )
    Path(args.json_path).write_text(json.dumps(report, indent=2))
    print(format_report(report))
    return 0


def run(
    model: str, dtype: str, new_tokens: int, text: str, chunk: int, max_tokens: int
) -> dict[str, object]:
    from slipstream.kernels.compute_thread import on_own_thread
    from slipstream.service.engine.config import EngineConfig
    from slipstream.service.engine.engine import Engine
    from slipstream.service.engine.loader import load_parts

    outputs: dict[str, list[list[int]]] = {}
    perplexity: dict[str, float] = {}
    top1: dict[str, list[int]] = {}
    num_tokens = 0
    for kv in ("auto", "int8"):
        parts = load_parts(
            EngineConfig(
                model=model, dtype=dtype, kv_cache_dtype=kv, max_num_seqs=16, policy="fcfs"
            )
        )
        ids = parts.tokenizer(text)["input_ids"][:max_tokens]
        num_tokens = len(ids)
        # On a thread that ends: its OpenMP team must not outlive it beside the engine's.
        perplexity[kv], top1[kv] = on_own_thread(
            functools.partial(text_perplexity, parts.model, parts.runner, ids, chunk),
            "slipstream-perplexity",
        )
        engine = Engine(parts.scheduler(), parts.runner, parts.tokenizer, parts.info)
        try:
            outputs[kv] = greedy(engine, parts.tokenizer, new_tokens)
        finally:
            engine.shutdown()
    reference, quantized = outputs["auto"], outputs["int8"]
    first_difference = [_first_difference(a, b) for a, b in zip(reference, quantized, strict=True)]
    return {
        "model": model,
        **hardware(dtype),
        "kv_cache_dtype": "int8",
        "greedy": {
            "prompts": len(PROMPTS),
            "identical": sum(a == b for a, b in zip(reference, quantized, strict=True)),
            "new_tokens": new_tokens,
            "first_difference": first_difference,
        },
        "perplexity": {
            "tokens": num_tokens,
            "chunk": chunk,
            "reference": perplexity["auto"],
            "quantized": perplexity["int8"],
            "ratio": perplexity["int8"] / perplexity["auto"],
            "top1_agreement": sum(a == b for a, b in zip(top1["auto"], top1["int8"], strict=True))
            / len(top1["auto"]),
        },
    }


def greedy(engine: object, tokenizer: object, new_tokens: int) -> list[list[int]]:
    from slipstream.service.engine.events import RequestSpec

    requests = [
        RequestSpec(
            req_id=f"p{i}",
            prompt_token_ids=tokenizer(prompt)["input_ids"],  # type: ignore[operator]
            max_new_tokens=new_tokens,
            ignore_eos=True,
        )
        for i, prompt in enumerate(PROMPTS)
    ]
    results = engine.generate(requests)  # type: ignore[attr-defined]
    return [list(result.token_ids) for result in results]


def text_perplexity(
    model: object, runner: object, ids: list[int], chunk: int
) -> tuple[float, list[int]]:
    """exp(mean negative log-likelihood) of ``ids[1:]``, the text prefilled in
    chunks over one sequence's blocks of the runner's device pool, and the
    most likely next token at each position."""
    import torch

    from slipstream.kernels.attention import build_attention_metadata

    block_size = runner.block_size  # type: ignore[attr-defined]
    blocks = list(range(-(-len(ids) // block_size)))
    total, count, top1 = 0.0, 0, []
    with torch.inference_mode():
        for start in range(0, len(ids) - 1, chunk):
            piece = ids[start : start + chunk]
            meta = build_attention_metadata(
                [len(piece)],
                [start + len(piece)],
                [blocks],
                block_size,
                torch.device("cpu"),
                model.dtype,  # type: ignore[attr-defined]
                for_torch_path=model.attention_backend == "torch",  # type: ignore[attr-defined]
            )
            logits = model.forward(  # type: ignore[attr-defined]
                torch.tensor(piece),
                torch.arange(start, start + len(piece)),
                runner.device_pool,  # type: ignore[attr-defined]
                meta,
                torch.arange(len(piece)),
            )
            targets = torch.tensor(ids[start + 1 : start + len(piece) + 1])
            scored = logits[: len(targets)].float()
            total += float(torch.nn.functional.cross_entropy(scored, targets, reduction="sum"))
            count += len(targets)
            top1 += scored.argmax(dim=-1).tolist()
    return math.exp(total / count), top1


def _first_difference(a: list[int], b: list[int]) -> int | None:
    """Tokens before the first that differs; None where the outputs are identical."""
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)


def format_report(report: dict[str, object]) -> str:
    greedy_part: dict[str, object] = report["greedy"]  # type: ignore[assignment]
    ppl: dict[str, float] = report["perplexity"]  # type: ignore[assignment]
    firsts = greedy_part["first_difference"]
    cpu: dict[str, object] = report["cpu"]  # type: ignore[assignment]
    return "\n".join(
        [
            f"model {report['model']}, dtype {report['dtype']}, CPU {cpu.get('model', '')}",
            f"greedy, {greedy_part['new_tokens']} new tokens: {greedy_part['identical']} of "
            f"{greedy_part['prompts']} prompts identical with an int8 KV cache; "
            f"first difference at token {firsts}",
            f"perplexity over {ppl['tokens']} tokens (chunks of {ppl['chunk']}): "
            f"{ppl['reference']:.4f} reference, {ppl['quantized']:.4f} int8 "
            f"({ppl['ratio']:.4f}x); most likely next token the same at "
            f"{100 * ppl['top1_agreement']:.2f} % of positions",
        ]
    )
