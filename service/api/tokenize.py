"""The answer to ``Tokenize``, refused before it is built when it would not
fit in one gRPC message.

Text under ``--max-prompt-bytes`` can tokenize to an answer several times
the message limit (4 MiB of emoji: 4M tokens, a 25 MB answer), and building
its per-token strings and its message holds the GIL for seconds (1.4-2.7 s
for 4M tokens on a 2-core box, while every other call waits), only for gRPC
to refuse to send it. The size of the answer follows from the ids alone,
through a table of what each vocabulary id adds to it: summing that over 4M
ids takes ~0.1 s.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from slipstream.v1 import inference_pb2 as pb

if TYPE_CHECKING:
    from tokenizers import Tokenizer


class AnswerTooLarge(ValueError):
    """A Tokenize answer over the message limit (INVALID_ARGUMENT)."""


def _varint_bytes(value: int) -> int:
    return max(1, (value.bit_length() + 6) // 7)


class TokenCosts:
    """What each vocabulary id adds to a ``TokenizeResponse``: its varint in
    the packed ``token_ids``, and its string in ``tokens`` (tag, length, UTF-8)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        vocab = tokenizer.get_vocab(with_added_tokens=True)
        size = max(vocab.values(), default=-1) + 1
        self._id_bytes = [_varint_bytes(i) for i in range(size)]
        self._token_bytes = [2] * size  # an id without a string: an empty one
        for token, token_id in vocab.items():
            length = len(token.encode())
            self._token_bytes[token_id] = 1 + _varint_bytes(length) + length

    def answer_bytes(self, ids: list[int]) -> int:
        """The serialized size of the answer made of ``ids`` and their strings."""
        if not ids:
            return 0
        id_bytes = sum(map(self._id_bytes.__getitem__, ids))
        token_bytes = sum(map(self._token_bytes.__getitem__, ids))
        return 1 + _varint_bytes(id_bytes) + id_bytes + token_bytes


def tokenize(
    tokenizer: Tokenizer, costs: TokenCosts, text: str, add_special: bool, max_bytes: int
) -> pb.TokenizeResponse:
    """``text``'s ids and token strings, or AnswerTooLarge once the ids show
    the answer would be over ``max_bytes``."""
    # encode_batch releases the GIL while it works (encode does not).
    encoding = tokenizer.encode_batch([text], add_special_tokens=add_special)[0]
    ids = encoding.ids
    num_bytes = costs.answer_bytes(ids)
    if num_bytes > max_bytes:
        raise AnswerTooLarge(
            f"the text is {len(ids)} tokens, a {num_bytes}-byte answer, over this "
            f"server's message limit of {max_bytes} bytes; tokenize it in parts"
        )
    return pb.TokenizeResponse(token_ids=ids, tokens=encoding.tokens)
