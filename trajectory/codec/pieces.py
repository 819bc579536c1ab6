"""Encoding rendered template text piece by piece, the pieces between added tokens kept.

A fast tokenizer cuts its input at every added token (`<|im_start|>`, `<think>`, ...)
before anything else, and normalizes, pre-tokenizes and tokenizes each piece between
two added tokens on its own (`tokenizers`' added vocabulary: `extract_and_normalize`).
So the ids of a text are the ids of its pieces and added tokens, in order, and a piece
seen before need not be tokenized again. A turn's renders are mostly such repeats: the
comparison scaffolding (a fixed system message, `user\\nGo.`, role headers) and the
previous reply, which the codec renders four times per turn. Only what the turn adds
is tokenized.

That holds when nothing looks across a piece's edge, which is checked from the
tokenizer's own description, never assumed:

- no added token takes neighbouring whitespace or a word (`lstrip`, `rstrip`,
  `single_word` all False); one matched after normalization (`normalized=True`) only
  where the normalizer changes nothing (the core matches those in the pieces the raw
  ones leave, and so does this); special tokens are matched (`encode_special_tokens`
  False, no truncation or padding: `probe.encode` checks);
- the pre-tokenizer is made of steps that see one piece at a time: `Split`,
  `ByteLevel`, `Digits`, `Punctuation`, `Whitespace`, `WhitespaceSplit`, and
  `Metaspace` unless it prepends to the first piece only (`prepend_scheme: first`
  looks at the piece's place in the whole text);
- the normalizer and the model only ever see one piece (any of them);
- and the pieces' ids equal the whole text's ids on probe texts built from the
  tokenizer's added tokens (a last check of the rules above).

Any other tokenizer is encoded whole, as before.
"""

from __future__ import annotations

import json
import re
import threading
import weakref
from collections.abc import Sequence
from typing import Any

_PER_PIECE = frozenset({"Split", "ByteLevel", "Digits", "Punctuation", "Whitespace", "WhitespaceSplit",
                        "Metaspace", "Sequence"})
_KEPT_PIECES = 8192
_KEPT_CHARS = 4_000_000  # all kept pieces together; cleared when either bound is passed
_KEPT_PIECE_CHARS = 65_536  # a longer piece (a pasted file) is tokenized each time, never kept


def _alternation(tokens: Sequence[str]) -> re.Pattern[str] | None:
    """A split on `tokens` that matches as the core does: leftmost, then longest.

    The tokens are laid out as a trie (`<|reserved_1`, `<|reserved_2`, ... share one
    branch): a flat alternation of the thousand-odd added tokens of a DeepSeek or
    gpt-oss tokenizer costs more to scan than the text costs to tokenize. At each node
    the longer continuations are tried before a token ending there (greedy), and a
    failed continuation falls back to it, so the match is the longest."""
    if not tokens:
        return None
    trie: dict[str, Any] = {}
    for token in tokens:
        node = trie
        for ch in token:
            node = node.setdefault(ch, {})
        node[""] = True  # a token ends here
    return re.compile("(" + _trie_pattern(trie) + ")")


def _trie_pattern(node: dict[str, Any]) -> str:
    branches = [re.escape(ch) + _trie_pattern(child) for ch, child in sorted(node.items()) if ch]
    if not branches:
        return ""
    body = branches[0] if len(branches) == 1 else "(?:" + "|".join(branches) + ")"
    if "" in node:  # a token ends here: a longer one first, else this one
        return "(?:" + body + ")?"
    return body


class PieceEncoder:
    """`encode(text)`: the core's ids for `text`, from its pieces (see module doc).

    `added` are matched on the raw text first; `added_normalized` (matched by the core
    after normalization) then within the pieces left, which is the same only where
    normalizing changes nothing (`_build` admits them only then)."""

    def __init__(self, core: Any, added: dict[str, int], added_normalized: dict[str, int] | None = None) -> None:
        self._core = core
        self.vocab_size = core.get_vocab_size(True)  # tokens added later: built again
        self._ids = {**(added_normalized or {}), **added}
        self._raw = _alternation(list(added))
        self._normalized = _alternation(list(added_normalized or {}))
        self._kept: dict[str, list[int]] = {}
        self._chars = 0

    def encode(self, text: str) -> list[int]:
        out: list[int] = []
        parts = self._raw.split(text) if self._raw is not None else [text]
        for i, part in enumerate(parts):
            if i % 2:
                out.append(self._ids[part])
            elif part:
                if self._normalized is None:
                    out += self._piece(part)
                    continue
                for j, sub in enumerate(self._normalized.split(part)):
                    if j % 2:
                        out.append(self._ids[sub])
                    elif sub:
                        out += self._piece(sub)
        return out

    def _piece(self, piece: str) -> list[int]:
        ids = self._kept.get(piece)
        if ids is None:
            ids = self._core.encode(piece, add_special_tokens=False).ids
            if len(piece) > _KEPT_PIECE_CHARS:
                return ids  # type: ignore[no-any-return]
            if len(self._kept) >= _KEPT_PIECES or self._chars + len(piece) > _KEPT_CHARS:
                self._kept = {}
                self._chars = 0
            self._kept[piece] = ids
            self._chars += len(piece)
        return ids


_lock = threading.Lock()
_encoders: weakref.WeakKeyDictionary[Any, PieceEncoder | None] = weakref.WeakKeyDictionary()


def piece_encoder(core: Any) -> PieceEncoder | None:
    """The tokenizer core's piece encoder, or None where it must encode whole (built once,
    and again if tokens were added since)."""
    try:
        kept = _encoders[core]
        if kept is None or kept.vocab_size == core.get_vocab_size(True):
            return kept
    except KeyError:
        pass
    except TypeError:  # not weak-referenceable: no encoder kept for it
        return None
    encoder = _build(core)
    with _lock:
        _encoders[core] = encoder
    return encoder


def _build(core: Any) -> PieceEncoder | None:
    try:
        added_tokens = core.get_added_tokens_decoder()
        pre, norm = core.pre_tokenizer, core.normalizer
        pre_spec = json.loads(pre.__getstate__()) if pre is not None else None
        norm_spec = json.loads(norm.__getstate__()) if norm is not None else None
    except Exception:
        return None
    if not added_tokens or not _per_piece(pre_spec):
        return None
    raw: dict[str, int] = {}
    normalized: dict[str, int] = {}
    for tid, tok in added_tokens.items():
        if tok.lstrip or tok.rstrip or tok.single_word:
            return None
        (normalized if tok.normalized else raw)[tok.content] = tid
    if normalized and not _identity(norm_spec):
        return None
    try:
        encoder = PieceEncoder(core, raw, normalized)
    except (RecursionError, re.error):  # an added token too long for the trie's pattern
        return None
    for text in _probe_texts([tok.content for tok in added_tokens.values()]):
        if encoder.encode(text) != core.encode(text, add_special_tokens=False).ids:
            return None
    encoder._kept, encoder._chars = {}, 0
    return encoder


def _identity(spec: Any) -> bool:
    """Whether the normalizer changes nothing (none, or an empty sequence: DeepSeek's)."""
    return spec is None or (spec.get("type") == "Sequence" and not spec.get("normalizers"))


def _per_piece(spec: Any) -> bool:
    """Whether every pre-tokenizer step sees one piece at a time (see module doc)."""
    if spec is None:
        return True
    kind = spec.get("type")
    if kind not in _PER_PIECE:
        return False
    if kind == "Sequence":
        return all(_per_piece(step) for step in spec.get("pretokenizers", ()))
    if kind == "Metaspace":
        return spec.get("prepend_scheme", "always") != "first"
    return True


def _probe_texts(added: Sequence[str]) -> list[str]:
    """Texts that put added tokens against spaces, newlines, letters, digits and accents."""
    tokens = list(added)[:8] or [""]
    glue = ["", " ", "\n", "\n\n", "  x", "Go.", "é\u0301", "12 ", " ▁a"]
    texts = []
    for i, tok in enumerate(tokens):
        left, right = glue[i % len(glue)], glue[(i + 3) % len(glue)]
        texts.append(f"{left}{tok}{right}word{tok}{tok} end\n")
    texts.append("".join(tokens) + " tail")
    texts.append(" lead " + " ".join(tokens))
    return texts
