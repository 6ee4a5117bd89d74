"""The outbound buffer's coalescing: a request's unread token events leave as
one, its order and the buffer's bounds as without it."""

from __future__ import annotations

from slipstream.scheduler.request import FinishReason
from slipstream.service.api import session
from slipstream.service.api.outbox import Outbox
from slipstream.service.engine.events import FinishEvent, TokenEvent


def _tokens(req: str, index: int, ids: list[int], step: int) -> tuple[str, TokenEvent]:
    text = "".join(chr(97 + i % 26) for i in ids)
    return req, TokenEvent(req, ids, text, index, step, step, 2, 0.0)


def _put(outbox: Outbox, item: object) -> bool:
    event = item[1]  # type: ignore[index]
    merge = session._merge_tokens if isinstance(event, TokenEvent) else None
    return outbox.put(item, 10, item[0], merge)  # type: ignore[index,arg-type]


def _drain(outbox: Outbox) -> list[object]:
    out = []
    while (item := outbox.pop()) is not None:
        out.append(item)
    return out


def test_a_readers_backlog_leaves_one_chunk_a_request_in_order() -> None:
    outbox: Outbox = Outbox(max_events=100, max_bytes=10_000)
    for step in range(3):
        for req in ("a", "b"):
            _put(outbox, _tokens(req, step, [step], step))
    finish = FinishEvent("a", FinishReason.MAX_TOKENS)
    _put(outbox, ("a", finish))
    _put(outbox, _tokens("b", 3, [3], 3))
    assert len(outbox) == 8 and outbox.num_bytes == 80  # puts, merged or not
    a, b, fin = _drain(outbox)
    assert a == ("a", TokenEvent("a", [0, 1, 2], "abc", 0, 0, 0, 2, 0.0))
    assert b[1].token_ids == [0, 1, 2, 3] and b[1].text == "abcd" and b[1].index == 0
    assert fin == ("a", finish)
    assert len(outbox) == 0 and outbox.num_bytes == 0


def test_read_items_and_finishes_end_a_merge() -> None:
    outbox: Outbox = Outbox(max_events=100, max_bytes=10_000)
    _put(outbox, _tokens("a", 0, [0], 0))
    assert outbox.pop() == _tokens("a", 0, [0], 0)
    _put(outbox, _tokens("a", 1, [1], 1))  # its predecessor was read: a new item
    _put(outbox, ("a", FinishEvent("a", FinishReason.EOS)))
    _put(outbox, _tokens("a", 2, [2], 2))  # never after a finish; kept apart if it were
    items = _drain(outbox)
    assert [type(i[1]).__name__ for i in items] == ["TokenEvent", "FinishEvent", "TokenEvent"]


def test_tokens_that_do_not_follow_on_are_not_merged() -> None:
    outbox: Outbox = Outbox(max_events=100, max_bytes=10_000)
    _put(outbox, _tokens("a", 0, [0], 0))
    _put(outbox, _tokens("a", 5, [5], 1))  # a gap in the indices
    assert len(_drain(outbox)) == 2


def test_bounds_count_every_put_so_backpressure_is_unchanged() -> None:
    outbox: Outbox = Outbox(max_events=4, max_bytes=10_000)
    full = [_put(outbox, _tokens("a", i, [i], i)) for i in range(4)]
    assert full == [False, False, False, True] and len(outbox) == 4
    assert not outbox.is_drained
    ((_, event),) = _drain(outbox)
    assert event.token_ids == [0, 1, 2, 3] and outbox.is_drained


def test_drop_takes_merged_puts_with_it() -> None:
    outbox: Outbox = Outbox(max_events=100, max_bytes=10_000)
    for i in range(3):
        _put(outbox, _tokens("a", i, [i], i))
        _put(outbox, _tokens("b", i, [i], i))
    assert outbox.drop(lambda item: item[0] == "a") == 3
    assert len(outbox) == 3 and outbox.num_bytes == 30
    _put(outbox, _tokens("a", 3, [3], 3))  # a's merge ended with its item
    items = _drain(outbox)
    assert [(r, e.token_ids) for r, e in items] == [("b", [0, 1, 2]), ("a", [3])]


def test_items_without_a_key_are_never_merged() -> None:
    outbox: Outbox = Outbox(max_events=100, max_bytes=10_000)
    outbox.put("x", 1)
    outbox.put("y", 1)
    assert _drain(outbox) == ["x", "y"]


def test_a_batch_takes_what_waits_in_order_up_to_its_bound(monkeypatch) -> None:
    class _Engine:
        pass

    stream = session.StreamSession(_Engine(), None, None)  # type: ignore[arg-type]
    for i in range(5):
        _put(stream._outbox, _tokens(f"r{i}", 0, [i], 0))
    monkeypatch.setattr(session, "MAX_BATCH_RESPONSES", 3)
    first = stream._to_response(stream._outbox.pop())
    batch = stream._batched(first)
    assert [r.request_id for r in batch.batch.responses] == ["r0", "r1", "r2"]
    last = stream._to_response(stream._outbox.pop())
    assert stream._batched(last).batch.responses[-1].request_id == "r4"
    alone = stream._to_response(_tokens("r9", 0, [9], 0))
    assert stream._batched(alone) is alone  # nothing waits: sent as it is


def test_only_the_exact_metadata_asks_for_batches() -> None:
    assert session.wants_batches([("slipstream-batch", "1")])
    assert not session.wants_batches([("slipstream-batch", "0"), ("other", "1")])
    assert not session.wants_batches([])
