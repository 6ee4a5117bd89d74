"""Structured output in the engine (service/engine/grammar.py) on ``tiny``,
whose random weights would never write a number or a JSON string unasked:
each constrained output matches its constraint, greedy and sampled, and
ends STOP_SEQUENCE as soon as it is complete; a constrained request beside
unconstrained ones leaves theirs as they were; planning ahead lands a step
with a constrained row before planning the next; preemption (swap and
recompute) keeps a constrained request's tokens; bad constraints are
refused with llguidance's message; the mask itself, against a reference."""

from __future__ import annotations

import json
import re
import threading
import time

import pytest
import torch

from slipstream.scheduler.request import FinishReason
from slipstream.service.engine import grammar as grammar_module
from slipstream.service.engine.config import EngineConfig
from slipstream.service.engine.cuda_runner import DeviceRunner, move_model_to
from slipstream.service.engine.engine import Engine, _Collector
from slipstream.service.engine.events import (
    ConstraintKind,
    OutputConstraint,
    RequestSpec,
    SamplingParams,
    TokenEvent,
)
from slipstream.service.engine.grammar import (
    STEP_LEXER_FUEL,
    STEP_MAX_ITEMS,
    ConstraintTooComplex,
    Grammar,
    GrammarCache,
    GrammarCompiler,
    InvalidConstraint,
    MaskBudget,
    mask_logits,
)
from slipstream.service.engine.loader import load_engine, load_parts
from slipstream.service.models.llama import LlamaModel

DIGITS = OutputConstraint(ConstraintKind.REGEX, "[0-9]{3}")
YES_NO = OutputConstraint(ConstraintKind.JSON_SCHEMA, '{"enum": ["yes", "no"]}')
PROMPTS = ["Once upon a time", "The capital of France is", "def main():"]


def _engine(tiny_model_dir, **options) -> Engine:
    options = {"dtype": "float32", "block_size": 16, **options}
    engine = load_engine(EngineConfig(model=str(tiny_model_dir), **options))
    engine.start()
    return engine


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    eng = _engine(tiny_model_dir)
    yield eng
    eng.shutdown()


def _spec(engine, req_id, text, constraint=None, sampling=None, **fields) -> RequestSpec:
    return RequestSpec(
        req_id=req_id,
        prompt_token_ids=engine.tokenizer.encode(text),
        max_new_tokens=fields.pop("max_new_tokens", 24),
        sampling=sampling or SamplingParams(),
        constraint=constraint,
        **fields,
    )


def _matches(constraint: OutputConstraint, text: str) -> bool:
    if constraint is DIGITS:
        return re.fullmatch("[0-9]{3}", text) is not None
    return json.loads(text) in ("yes", "no")


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_constrained_outputs_match_and_stop_when_complete(engine, temperature):
    requests = [
        _spec(engine, f"{kind}{i}", text, constraint, SamplingParams(temperature, seed=i))
        for kind, constraint in (("digits", DIGITS), ("yes_no", YES_NO))
        for i, text in enumerate(PROMPTS)
    ]
    for request, result in zip(requests, engine.generate(requests), strict=True):
        assert _matches(request.constraint, result.text), (request.req_id, result.text)
        # Complete after its last character: it ends there, no EOS step more.
        assert result.finish.reason is FinishReason.STOP_SEQUENCE, result.finish
        assert result.token_ids[-1] not in engine.info.eos_token_ids


def test_greedy_rows_are_masked_where_the_lm_head_picks_tokens_itself(tiny_model_dir, engine):
    """bf16 panels pick a greedy step's tokens in the LM head, without
    logits (where this CPU has them): a step with a constrained row must
    take the logits, to mask them."""
    bf16 = _engine(tiny_model_dir, dtype="bfloat16")
    try:
        requests = [_spec(bf16, "yes_no", PROMPTS[0], YES_NO), _spec(bf16, "d", PROMPTS[1], DIGITS)]
        results = bf16.generate(requests)
    finally:
        bf16.shutdown()
    assert _matches(YES_NO, results[0].text) and _matches(DIGITS, results[1].text)


def test_a_constrained_request_leaves_its_batch_neighbours_as_they_were(tiny_model_dir, engine):
    plain = [_spec(engine, f"plain{i}", text, max_new_tokens=12) for i, text in enumerate(PROMPTS)]
    alone = [r.token_ids for r in engine.generate(plain)]
    constrained = _spec(engine, "c", PROMPTS[0], YES_NO)
    collectors = {r.req_id: _Collector() for r in [constrained, *plain]}
    batch_sizes: list[int] = []

    def on_constrained(event):
        if isinstance(event, TokenEvent):
            batch_sizes.append(event.batch_size)
        collectors["c"].on_event(event)

    fresh = load_engine(EngineConfig(model=str(tiny_model_dir), dtype="float32", block_size=16))
    try:  # submitted before it starts: all four in its first step
        fresh.submit(constrained, on_constrained)
        for r in plain:
            fresh.submit(r, collectors[r.req_id].on_event)
        fresh.start()
        together = [collectors[r.req_id].wait(r.req_id).token_ids for r in plain]
        answer = collectors["c"].wait("c").text
    finally:
        fresh.shutdown()
    assert together == alone
    assert _matches(YES_NO, answer)
    assert batch_sizes[0] == 4, "the constrained request ran beside the others"


def test_planning_ahead_lands_a_constrained_step_before_the_next(tiny_model_dir, engine):
    """The CPU runs a step at its launch, so a step planned ahead would mask
    its row before the previous token reached the matcher (a JSON string's
    opening quote, twice): it must wait for that step's results."""
    requests = [
        _spec(engine, f"q{i}", text, constraint)
        for i, (text, constraint) in enumerate(
            [(PROMPTS[0], YES_NO), (PROMPTS[1], DIGITS), (PROMPTS[2], None)]
        )
    ]
    behind = engine.generate(requests)
    ahead_engine = _engine(tiny_model_dir, plan_ahead=True)
    try:
        ahead = ahead_engine.generate(requests)
    finally:
        ahead_engine.shutdown()
    summary = [(r.token_ids, r.finish.reason) for r in ahead]
    assert summary == [(r.token_ids, r.finish.reason) for r in behind]
    assert _matches(YES_NO, ahead[0].text) and _matches(DIGITS, ahead[1].text)


def test_bad_constraints_are_refused_with_the_compilers_message(engine):
    cases = {
        OutputConstraint(ConstraintKind.REGEX, "[0-9"): "unclosed character class",
        OutputConstraint(ConstraintKind.JSON_SCHEMA, '{"type": "nope"}'): "nope",
        OutputConstraint(ConstraintKind.JSON_SCHEMA, "{not json"): "not valid JSON",
        OutputConstraint(ConstraintKind.REGEX, ""): "regex is empty",
    }
    for constraint, words in cases.items():
        with pytest.raises(InvalidConstraint, match=re.escape(words)):
            engine.submit(_spec(engine, "bad", "x", constraint), lambda event: None)
    stats = engine.stats()
    assert (stats.waiting, stats.running) == (0, 0)


# Nested deeper than Python's stack: json.loads raised RecursionError.
DEEP_SCHEMA = OutputConstraint(ConstraintKind.JSON_SCHEMA, '{"not":' * 6000 + "{}" + "}" * 6000)
# llguidance's message repeats the expression: 160 KB of it.
NESTED_GROUPS = OutputConstraint(ConstraintKind.REGEX, "(" * 20_000 + "a" + ")" * 20_000)


def test_whatever_fails_in_a_compile_is_the_constraints_refusal(engine, monkeypatch):
    with pytest.raises(InvalidConstraint, match="json_schema is nested too deeply"):
        _compiler(engine).compile(DEEP_SCHEMA)

    def fails(text):
        raise RuntimeError("something unforeseen")

    monkeypatch.setattr(grammar_module.llguidance.LLMatcher, "grammar_from_regex", fails)
    with pytest.raises(InvalidConstraint, match="regex does not compile: RuntimeError: some"):
        engine.submit(_spec(engine, "odd", "x", DIGITS_TWICE), lambda event: None)


DIGITS_TWICE = OutputConstraint(ConstraintKind.REGEX, "[0-9]{2}")  # not compiled before


def test_a_compilers_message_is_one_short_line(engine):
    with pytest.raises(InvalidConstraint) as info:
        _compiler(engine).compile(NESTED_GROUPS)
    message = str(info.value)
    assert message.startswith("regex: ") and "invalid regex" in message
    assert len(message) <= grammar_module.MAX_MESSAGE_CHARS and "\n" not in message


def test_the_mask_allows_eos_only_where_the_output_is_complete(engine):
    grammar = engine.grammars.compile(OutputConstraint(ConstraintKind.REGEX, "[0-9]{1,2}"))
    matcher = grammar.start()
    vocab = engine.info.vocab_size
    eos = engine.info.eos_token_ids[0]
    digit = engine.tokenizer.convert_tokens_to_ids("7")

    def allowed() -> set[int]:
        logits = torch.zeros(1, vocab)
        mask_logits(logits, ["r"], {"r": matcher})
        return set(torch.nonzero(logits[0] == 0).flatten().tolist())

    first = allowed()
    assert digit in first and eos not in first
    assert not matcher.take(digit)
    second = allowed()
    assert digit in second and eos in second  # one digit is a whole match
    assert matcher.take(digit)  # two: complete, nothing may follow
    assert allowed() == {eos}


def test_the_mask_touches_only_constrained_rows_and_blocks_padding():
    """Against a reference: row 1 of 3 constrained, the logits 40 wider than
    the bitmask's 64 tokens (a padded vocabulary)."""

    class Fixed:
        mask_words = 2

        def fill(self, bitmask, row):
            bitmask[row] = torch.tensor([0b1011, -(2**31)], dtype=torch.int32)

    logits = torch.randn(3, 104)
    before = logits.clone()
    mask_logits(logits, ["a", "b", "c"], {"b": Fixed(), "z": Fixed()})
    allowed = {0, 1, 3, 63}
    expected = before.clone()
    expected[1] = torch.tensor(
        [v if t in allowed else float("-inf") for t, v in enumerate(before[1].tolist())]
    )
    assert torch.equal(logits, expected)


# ---------------------------------------------------------------- compiled grammars kept


def _compiler(engine: Engine, **options) -> GrammarCompiler:
    return GrammarCompiler(engine.tokenizer, engine.info.eos_token_ids, **options)


def test_an_equal_constraint_is_compiled_once(engine):
    compiler = _compiler(engine)
    text = '{"type": "object", "properties": {"n": {"type": "integer"}}}'
    first = OutputConstraint(ConstraintKind.JSON_SCHEMA, text)
    assert compiler.cached(first) is None
    grammar = compiler.compile(first)
    again = OutputConstraint(ConstraintKind.JSON_SCHEMA, text)  # equal, another object
    assert compiler.cached(again) is grammar
    assert compiler.compile(again) is grammar
    assert compiler.compile(OutputConstraint(ConstraintKind.REGEX, "[0-9]+")) is not grammar


def test_a_constraint_that_does_not_compile_is_not_kept(engine):
    compiler = _compiler(engine)
    bad = OutputConstraint(ConstraintKind.REGEX, "[0-9")
    for _ in range(2):
        with pytest.raises(InvalidConstraint, match="unclosed character class"):
            compiler.compile(bad)
    assert compiler.cached(bad) is None


def test_kept_grammars_are_bounded_by_count_and_bytes():
    def grammar(text: str, kind: ConstraintKind = ConstraintKind.REGEX) -> Grammar:
        return Grammar(kind, text, template=None, mask_words=1)

    def kept(text: str, kind: ConstraintKind = ConstraintKind.REGEX) -> Grammar | None:
        return cache.get(OutputConstraint(kind, text))

    cache = GrammarCache(max_entries=2, max_bytes=10)
    a, b, c = grammar("aaa"), grammar("bbb"), grammar("ccc")
    cache.put(a)
    cache.put(b)
    assert kept("aaa") is a  # the most recently used now
    cache.put(c)  # a third: b, the least recently used, goes
    assert (kept("bbb"), kept("aaa"), kept("ccc")) == (None, a, c)
    assert kept("ccc", ConstraintKind.JSON_SCHEMA) is None  # the kind is part of the key
    d = grammar("dddddd")  # 3 + 3 + 6 bytes: over 10, a goes
    cache.put(d)
    assert (kept("aaa"), kept("ccc"), kept("dddddd")) == (None, c, d)
    assert (len(cache), cache.num_bytes) == (2, 9)
    cache.put(grammar("é" * 6))  # 12 bytes of UTF-8: never kept, nothing dropped
    assert kept("é" * 6) is None and (len(cache), cache.num_bytes) == (2, 9)


def test_one_kept_grammar_serves_requests_on_many_threads(engine):
    """A kept grammar's template is copied by every front-door thread at
    once, and its matchers run beside each other."""
    grammar = engine.grammars.compile(DIGITS)
    digit = engine.tokenizer.convert_tokens_to_ids("7")
    errors: list[BaseException] = []

    def requests() -> None:
        try:
            bitmask = torch.empty((1, grammar.mask_words), dtype=torch.int32)
            for _ in range(200):
                matcher = grammar.start()
                for _ in range(3):
                    matcher.fill(bitmask, 0)
                    complete = matcher.take(digit)
                assert complete
        except BaseException as exc:  # reported below, from the main thread
            errors.append(exc)

    threads = [threading.Thread(target=requests) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []


# ---------------------------------------------------------------- a step's limits

# An expression whose lexer builds states as the text goes: ~4,900 fuel at
# its costliest step on tiny's vocabulary.
COSTLY = OutputConstraint(ConstraintKind.REGEX, "(.*a.{20})")
COSTLY_TEXT = "banana and a bag of apples as a snack " * 3


def test_matchers_are_built_with_the_step_limits(engine, monkeypatch):
    real = grammar_module.llguidance.LLMatcher
    limits = []

    class Spy:
        grammar_from_json_schema = staticmethod(real.grammar_from_json_schema)
        grammar_from_regex = staticmethod(real.grammar_from_regex)

        def __new__(cls, *args, **kwargs):
            limits.append(kwargs.get("limits"))
            return real(*args, **kwargs)

    monkeypatch.setattr(grammar_module.llguidance, "LLMatcher", Spy)
    _compiler(engine).compile(DIGITS)
    (used,) = limits
    assert (used.step_lexer_fuel, used.step_max_items) == (STEP_LEXER_FUEL, STEP_MAX_ITEMS)
    assert (STEP_LEXER_FUEL, STEP_MAX_ITEMS) == (20_000, 10_000)  # llguidance's: 200k, 50k
    assert not used.verbose_errors


def _unprobed(engine: Engine, **options) -> GrammarCompiler:
    """A compiler that leaves out its probe: what it would refuse reaches the
    engine thread, as a grammar costly only further on would."""
    compiler = _compiler(engine, **options)
    compiler._probe = lambda grammar: None  # type: ignore[method-assign]
    return compiler


def test_a_mask_past_the_step_limits_fails_its_request_alone(engine):
    seven = engine.tokenizer.convert_tokens_to_ids("7")
    for fuel, fails in ((STEP_LEXER_FUEL, False), (2_000, True)):
        costly = _compiler(engine, step_lexer_fuel=fuel).compile(COSTLY).start()
        digits = engine.grammars.compile(LONG_DIGITS).start()
        failed = None
        for token in engine.tokenizer.encode(COSTLY_TEXT, add_special_tokens=False):
            logits = torch.zeros(2, engine.info.vocab_size)
            mask_logits(logits, ["costly", "digits"], {"costly": costly, "digits": digits})
            assert logits[1, seven] == 0 and logits[1].isinf().sum() > 0  # its own mask
            digits.take(seven)
            try:
                costly.take(token)
            except ConstraintTooComplex as exc:
                eos = engine.info.eos_token_ids[0]
                assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == [eos]
                failed = exc
                break
        assert (failed is not None) == fails, failed
    assert "constraint too complex: it needs more work a step than allowed" in str(failed)
    assert "too many expressions" in str(failed) and "\n" not in str(failed)


def test_a_request_whose_mask_fails_ends_error_and_alone(engine):
    """Its mask past the limits allowed EOS alone: the EOS must not end it
    as a whole match (it did, finishing EOS with an opening brace)."""
    schema = '{"type": "object", "properties": {"a": {"type": "string"}}}'
    starved = _unprobed(engine, step_lexer_fuel=10)  # fails at its second step
    costly = starved.compile(OutputConstraint(ConstraintKind.JSON_SCHEMA, schema))
    requests = [
        _spec(engine, "costly", PROMPTS[0], costly),
        _spec(engine, "digits", PROMPTS[1], DIGITS),
        _spec(engine, "plain", PROMPTS[2], max_new_tokens=6),
    ]
    results = engine.generate(requests)
    assert results[0].finish.reason is FinishReason.ERROR, results[0]
    assert "constraint too complex: it needs more work" in results[0].finish.message
    assert _matches(DIGITS, results[1].text)
    assert results[1].finish.reason is FinishReason.STOP_SEQUENCE
    assert results[2].finish.reason is FinishReason.MAX_TOKENS


# ---------------------------------------------------------------- preemption

LONG_DIGITS = OutputConstraint(ConstraintKind.REGEX, "[0-9]{120}")  # ~60 tokens


def _run(engine: Engine, early: list[RequestSpec], late: list[RequestSpec]):
    collectors = {r.req_id: _Collector() for r in early + late}
    for r in early:
        engine.submit(r, collectors[r.req_id].on_event)
    give_up = time.monotonic() + 60.0
    while sum(len(collectors[r.req_id].token_ids) for r in early) < 6:
        assert time.monotonic() < give_up, "the early requests never started"
        time.sleep(0.005)
    for r in late:
        engine.submit(r, collectors[r.req_id].on_event)
    return {r.req_id: collectors[r.req_id].wait(r.req_id) for r in early + late}


@pytest.mark.parametrize("num_host_blocks", [10, 0], ids=["swap", "recompute"])
def test_preempted_constrained_requests_keep_their_tokens(tiny_model_dir, engine, num_host_blocks):
    """Background-class constrained requests hold the few device blocks
    when urgent ones arrive: preempted (swapped, or dropped and recomputed),
    they resume where their matcher is and give the tokens of a run alone."""
    deadline = time.monotonic() + 600.0
    early = [
        _spec(engine, f"c{i}", text, LONG_DIGITS, max_new_tokens=100, priority=2)
        for i, text in enumerate(PROMPTS)
    ]
    late = [
        _spec(engine, f"u{i}", text, max_new_tokens=16, ignore_eos=True, deadline=deadline)
        for i, text in enumerate(PROMPTS * 2)
    ]
    expected = {r.req_id: r.token_ids for r in engine.generate(early)}
    tight = _engine(
        tiny_model_dir,
        max_num_batched_tokens=64,
        num_device_blocks=8,
        num_host_blocks=num_host_blocks,
        max_num_seqs=3,
        policy="deadline",
    )
    try:
        results = _run(tight, early, late)
        stats = tight.stats()
    finally:
        tight.shutdown()
    assert sum(results[r.req_id].finish.num_preemptions for r in early) >= 1
    if num_host_blocks:
        assert stats.swap_preemptions >= 1
    else:
        assert stats.recompute_preemptions >= 1
    for r in early:
        assert results[r.req_id].token_ids == expected[r.req_id]
        assert re.fullmatch("[0-9]{120}", results[r.req_id].text)
        assert results[r.req_id].finish.reason is FinishReason.STOP_SEQUENCE
    assert stats.device_blocks.used == 0 and stats.host_blocks.used == 0


def test_the_device_runner_masks_as_the_cpu_runner_does(tiny_model_dir, engine):
    """``DeviceRunner`` (the GPU's, here on the CPU with Triton under its
    interpreter), planning ahead: the tokens ``ModelRunner`` gives, greedy
    and seeded, a constrained row beside a plain one."""
    requests = [
        _spec(engine, "yes_no", PROMPTS[0], YES_NO),
        _spec(engine, "digits", PROMPTS[1], DIGITS, SamplingParams(1.0, seed=5)),
        _spec(engine, "plain", PROMPTS[2], max_new_tokens=6),
    ]
    expected = [(r.token_ids, r.finish.reason) for r in engine.generate(requests)]
    config = EngineConfig(
        model=str(tiny_model_dir), dtype="float32", block_size=16, max_num_batched_tokens=48,
        max_model_len=256,
    )  # fmt: skip
    parts = load_parts(config)
    model = LlamaModel(tiny_model_dir, torch.float32, attention_backend="triton")
    move_model_to(model, torch.device("cpu"))
    runner = DeviceRunner(
        model, 64, 0, 16, device=torch.device("cpu"), max_num_seqs=4,
        max_num_batched_tokens=48, max_model_len=256, pin_memory=False,
    )  # fmt: skip
    device_engine = Engine(parts.scheduler(), runner, parts.tokenizer, parts.info, plan_ahead=True)
    try:
        got = [(r.token_ids, r.finish.reason) for r in device_engine.generate(requests)]
    finally:
        device_engine.shutdown()
    assert got == expected


# ---------------------------------------------------------------- costly grammars

# Tiny expressions of huge counted repeats: 45-300 ms a mask (SmolLM2) within
# the step limits, on the engine thread, every step of a request's output.
HUGE_REPEATS = {
    "ab_100000": OutputConstraint(ConstraintKind.REGEX, "(ab){100000}"),
    "a_300000": OutputConstraint(ConstraintKind.REGEX, "a{300000}"),
    "a_1000000": OutputConstraint(ConstraintKind.REGEX, "a{1000000}"),
    "schema_pattern": OutputConstraint(
        ConstraintKind.JSON_SCHEMA, json.dumps({"type": "string", "pattern": "^(ab){100000}$"})
    ),
}


@pytest.mark.parametrize("name", HUGE_REPEATS)
def test_huge_counted_repeats_are_refused_when_compiled(engine, name):
    constraint = HUGE_REPEATS[name]
    with pytest.raises(InvalidConstraint, match=f"{constraint.kind.value} is too complex"):
        _compiler(engine).compile(constraint)


def test_an_expression_that_matches_nothing_is_refused_when_compiled(engine):
    """It compiled, then ended ERROR at its first step ("needs more work a
    step than allowed: NoExtensionBias"), a server fault for the caller's."""
    with pytest.raises(InvalidConstraint, match="regex matches no output"):
        _compiler(engine).compile(OutputConstraint(ConstraintKind.REGEX, r"[^\s\S]"))


def test_a_grammar_whose_first_masks_take_too_long_is_refused(engine):
    with pytest.raises(InvalidConstraint, match="regex is too complex: its first masks took"):
        _compiler(engine, max_probe_s=0).compile(DIGITS)


def test_costly_masks_end_their_request_alone_as_too_complex(engine):
    one_mask = _compiler(engine, budget=MaskBudget(max_mask_s=0)).compile(LONG_DIGITS)
    on_average = _compiler(engine, budget=MaskBudget(max_mean_mask_s=0, masks_before_mean=3))
    requests = [
        _spec(engine, "one_mask", PROMPTS[0], one_mask),
        _spec(engine, "on_average", PROMPTS[1], on_average.compile(LONG_DIGITS)),
        _spec(engine, "digits", PROMPTS[2], DIGITS),
        _spec(engine, "plain", PROMPTS[0], max_new_tokens=6),
    ]
    results = engine.generate(requests)
    assert results[0].finish.reason is FinishReason.ERROR, results[0]
    assert results[0].finish.message.startswith("constraint too complex: a mask took")
    assert results[1].finish.reason is FinishReason.ERROR, results[1]
    assert "on average over 3 steps" in results[1].finish.message
    assert len(results[1].token_ids) == 2  # the third, taken after the third mask, is not sent
    assert results[1].finish.num_output_tokens == 2  # nor counted as output
    assert _matches(DIGITS, results[2].text)
    assert results[3].finish.reason is FinishReason.MAX_TOKENS


def test_a_token_the_lexer_gives_up_on_is_too_complex_not_a_broken_constraint(engine):
    """Its mask allowed the token: not a sampler's fault (it was logged as
    one, ``constraint_broken`` at error level)."""
    huge = _unprobed(engine).compile(HUGE_REPEATS["a_1000000"])
    results = engine.generate([_spec(engine, "huge", PROMPTS[0], huge)])
    assert results[0].finish.reason is FinishReason.ERROR
    assert results[0].finish.message.startswith(
        "constraint too complex: lexer error: too many expressions"
    ), results[0].finish.message
