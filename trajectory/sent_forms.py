"""Digests of the message forms a client sent that are known to match a line's messages.

An agent re-sends its whole conversation every turn. Telling each re-sent message from
the committed one field by field (`messages.messages_equal`, `match_returned`) is
Python work for every message of the history, every turn: the largest share of a small
turn's CPU once histories grow. Once a sent message has matched message `i` of a line,
the digest of its exact JSON is kept here; the next request's message `i` is the same
when its digest is, which costs one `orjson.dumps` and one hash in C. Only a message
not seen before in that exact form runs the tolerant comparison, so the Python work per
turn follows the new messages.

The digest is of `orjson.dumps`: key order, JSON types (`1`, `1.0` and `true` differ)
and values all count, so equal digests mean byte-identical JSON, the same message by
any comparison (BLAKE2b, 128 bits: a collision is not a practical event). orjson writes
a NaN as `null`, but every message here was parsed from JSON text, which has no NaN.
A form orjson cannot write (an int beyond 64 bits) has no digest and is always compared
field by field.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

import orjson

__all__ = ["SentForms", "form_digest"]

DIGEST_BYTES = 16


def form_digest(message: Mapping[str, Any]) -> bytes | None:
    """The digest of `message`'s exact JSON, or None when orjson cannot write it."""
    try:
        raw = orjson.dumps(message)
    except TypeError:
        return None
    return hashlib.blake2b(raw, digest_size=DIGEST_BYTES).digest()


class SentForms:
    """One digest slot per message of a line, in one buffer (no object per message;
    an all-zero slot is "none known")."""

    __slots__ = ("_buf",)

    def __init__(self) -> None:
        self._buf = bytearray()

    def matches(self, i: int, digest: bytes) -> bool:
        """Whether a sent form with `digest` is known to match message `i`."""
        return self._buf[i * DIGEST_BYTES:(i + 1) * DIGEST_BYTES] == digest

    def note(self, i: int, digest: bytes) -> None:
        """Remember that the form with `digest` matched message `i`."""
        end = (i + 1) * DIGEST_BYTES
        if len(self._buf) < end:
            self._buf.extend(bytes(end - len(self._buf)))
        self._buf[end - DIGEST_BYTES:end] = digest

    def truncate(self, n_messages: int) -> None:
        """Forget what is known past the first `n_messages` (a rollback removed them)."""
        del self._buf[n_messages * DIGEST_BYTES:]
