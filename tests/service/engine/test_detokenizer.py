"""``IncrementalDetokenizer`` on the tiny model's byte-level tokenizer, which
spends a token on each byte of an emoji: the text it releases is the text
``tokenizer.decode`` gives, whatever the prompt's last ids split."""

from __future__ import annotations

from pathlib import Path

import pytest
from tokenizers import Tokenizer

from slipstream.service.engine.detokenizer import IncrementalDetokenizer

TEXTS = ["Party time: 🎉🎉🎉 and 🎉 fun", "日本語、👨‍👩‍👧 é ok"]


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> Tokenizer:
    return Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))


def _stream(
    tokenizer: Tokenizer, prompt_ids: list[int], output_ids: list[int], stops: tuple[str, ...] = ()
) -> list[str]:
    detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids, stops)
    deltas = [detokenizer.add(token_id) for token_id in output_ids]
    return [*deltas, detokenizer.flush()]


def test_an_emoji_is_several_tokens(tokenizer: Tokenizer) -> None:
    # What the tests below rely on: a prompt can end inside a character.
    assert len(tokenizer.encode("🎉", add_special_tokens=False).ids) == 4


@pytest.mark.parametrize("num_cut", [1, 2, 3])
def test_an_output_that_completes_the_prompts_character_shows_it_once(
    tokenizer: Tokenizer, num_cut: int
) -> None:
    ids = tokenizer.encode("Party time: 🎉🎉🎉", add_special_tokens=False).ids
    output_ids = ids[-num_cut:] + tokenizer.encode("\n\nok", add_special_tokens=False).ids
    # The prompt's last four ids start inside the emoji before the cut one too.
    assert tokenizer.decode(ids[:-num_cut][-4:]).startswith("\ufffd")
    assert "".join(_stream(tokenizer, ids[:-num_cut], output_ids)) == "🎉\n\nok"


@pytest.mark.parametrize("text", TEXTS)
def test_prompt_text_and_output_text_make_the_whole_text(tokenizer: Tokenizer, text: str) -> None:
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    for cut in range(1, len(ids)):
        # A character the prompt leaves unfinished is the output's to show.
        prompt_text = tokenizer.decode(ids[:cut]).rstrip("\ufffd")
        deltas = _stream(tokenizer, ids[:cut], ids[cut:])
        assert "\ufffd" not in "".join(deltas), cut
        assert prompt_text + "".join(deltas) == text, cut


def test_bytes_the_output_leaves_invalid_stay_with_the_prompt(tokenizer: Tokenizer) -> None:
    emoji = tokenizer.encode("🎉", add_special_tokens=False).ids
    ok = tokenizer.encode("ok", add_special_tokens=False).ids
    prompt_ids = tokenizer.encode("a", add_special_tokens=False).ids + emoji[:2]
    assert tokenizer.decode(prompt_ids + ok) == "a\ufffdok"
    assert "".join(_stream(tokenizer, prompt_ids, ok)) == "ok"


STOP_TEXT = "The quick brown fox 🎉 jumps over the lazy dog"
STOP_CASES = [
    ("jumps", "jumps over"),  # overlapping: the first to end the text wins
    ("The",),  # at the very start
    ("🎉",),
    ("x 🎉 j", "zzz"),  # spans tokens
    ("o",),
    ("lazy cat", "dog"),
    ("fox jumps", "the lazy dogs", "brown fix"),  # begin to match, then do not
    ("fox 🎉 jumps" + "!" * 240,),  # long, matches its first 12 characters only
]


def _released_before_any_stop(text: str, stops: tuple[str, ...]) -> int:
    """How much of ``text`` (which holds no stop string) may go out: all but
    its longest tail that begins some stop string."""
    return next(
        (i for i in range(len(text)) if any(s.startswith(text[i:]) for s in stops)), len(text)
    )


@pytest.mark.parametrize("stops", STOP_CASES)
def test_only_text_that_could_begin_a_stop_string_is_held_back(
    tokenizer: Tokenizer, stops: tuple[str, ...]
) -> None:
    ids = tokenizer.encode(STOP_TEXT, add_special_tokens=False).ids
    plain = IncrementalDetokenizer(tokenizer, [], ())
    detokenizer = IncrementalDetokenizer(tokenizer, [], stops)
    released = ""
    for token_id in ids:
        plain.add(token_id)
        released += detokenizer.add(token_id)
        if detokenizer.stopped:
            break
        assert len(released) == _released_before_any_stop(plain.text, stops), plain.text
    released += detokenizer.flush()
    cut = min((i for i in (STOP_TEXT.find(s) for s in stops) if i >= 0), default=len(STOP_TEXT))
    assert detokenizer.stopped is (cut < len(STOP_TEXT))
    assert released == detokenizer.text == STOP_TEXT[:cut]


def test_a_long_stop_string_that_never_begins_holds_nothing_back(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode(STOP_TEXT, add_special_tokens=False).ids
    deltas = _stream(tokenizer, [], ids, stops=("#" * 250, "¿" * 256))
    assert "".join(deltas[:-1]) == STOP_TEXT and deltas[-1] == ""


@pytest.mark.parametrize(
    ("min_tokens", "kept"),
    [
        (0, "ab"),  # the first "xy" stops it
        (3, "ab"),  # so it does where it ends in the 4th token's text
        (4, "abxyab"),  # ends within the first four tokens' text: the second stops it
        (8, "abxyabxy."),  # never a stop: every "xy" ends within the first 8
    ],
)
def test_a_stop_string_ending_within_min_tokens_does_not_stop(
    tokenizer: Tokenizer, min_tokens: int, kept: str
) -> None:
    """vLLM's semantics: the first ``min_tokens`` tokens' text cannot end the
    request; a stop string counts where it ends in a later token's text."""
    ids = [tokenizer.encode(c, add_special_tokens=False).ids[0] for c in "abxyabxy."]
    assert tokenizer.decode(ids) == "abxyabxy."  # one token a character
    detokenizer = IncrementalDetokenizer(tokenizer, [ids[0]], ("xy",), min_tokens)
    text = "".join(detokenizer.add(t) for t in ids) + detokenizer.flush()
    assert text == kept
    assert detokenizer.stopped is (min_tokens < 8)


def test_a_stop_string_begun_within_min_tokens_and_ended_after_stops(
    tokenizer: Tokenizer,
) -> None:
    ids = [tokenizer.encode(c, add_special_tokens=False).ids[0] for c in "abxyz"]
    detokenizer = IncrementalDetokenizer(tokenizer, [ids[0]], ("xyz", "b"), 3)
    text = "".join(detokenizer.add(t) for t in ids) + detokenizer.flush()
    assert text == "ab" and detokenizer.stopped  # "b", the 2nd token, is no stop
