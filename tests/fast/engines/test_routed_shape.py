"""Routing replay (R3): the row width of a routed-experts payload is exact, never a guess.

SGLang sends rows flat (base64 int32, no shape). The width comes from the rows the
session already holds, else both settings, else ids / positions asked when that
divides (split by whichever setting is set); a width that cannot be told is a 502
naming the settings (session_server/routed.py `_flat_rows`)."""

from __future__ import annotations

import base64

import numpy as np
import pytest

from session_server.errors import UpstreamInvalid
from session_server.routed import Piece, RoutedShape, join
from session_server.sim.routed import RoutedSpec, line_rows, vllm_payload

SPEC = RoutedSpec(layers=4, topk=2, num_experts=16)
IDS = list(range(100, 112))  # a 12-token line: rows for positions [0, 11)


def _flat(rows: np.ndarray) -> bytes:
    return b'"' + base64.b64encode(rows.astype(np.int32).tobytes()) + b'"'


def _piece(raw: bytes, start: int, prompt: int = 8, output: int = 4) -> Piece:
    return Piece(raw, prompt, output, start)


def test_an_engine_ignoring_the_start_is_cut_when_the_width_is_known() -> None:
    # an older SGLang answers every position from 0 although the turn asked from 9;
    # the session's earlier rows say 4 x 2: 11 rows, cut at 9 (the old guess read 2 rows of 16)
    rows = line_rows(IDS, SPEC)
    got = join([_piece(_flat(rows), 9)], start=9, end=11, shape=RoutedShape(topk=2), expect=(4, 2))
    np.testing.assert_array_equal(got, rows[9:])


def test_the_settings_give_the_width_of_a_first_segment() -> None:
    rows = line_rows(IDS, SPEC)
    got = join([_piece(_flat(rows), 0)], start=0, end=11, shape=RoutedShape(layers=4, topk=2))
    assert got.shape == (11, 4, 2) and got.dtype == np.uint8
    # one row too many is caught even where ids / positions would divide
    extra = np.concatenate([rows, rows[-1:]])
    with pytest.raises(UpstreamInvalid, match="12 routed-experts rows"):
        join([_piece(_flat(extra), 0)], start=0, end=11, shape=RoutedShape(layers=4, topk=2))


def test_settings_of_the_wrong_width_are_named_even_when_the_ids_split_into_their_rows() -> None:
    # 12 positions of 4 x 2 = 96 ids, which also split into 8 rows of the settings' 4 x 3:
    # the 502 names the settings whatever the turn's length, not only "8 rows for 12 positions"
    rows = line_rows(list(range(100, 113)), SPEC)
    assert rows.size == 96
    with pytest.raises(UpstreamInvalid, match="rows of 8 for the 12 positions asked, not of 4x3.*routed_experts_topk"):
        join([Piece(_flat(rows), 9, 4, 0)], start=0, end=12, shape=RoutedShape(layers=4, topk=3))


def test_an_unknown_width_is_inferred_only_when_it_divides_else_a_502_naming_the_settings() -> None:
    rows = line_rows(IDS, SPEC)
    got = join([_piece(_flat(rows), 0)], start=0, end=11, shape=RoutedShape(topk=2))
    assert got.shape == (11, 4, 2)  # 88 ids / 11 positions = 8 per row, split by topk 2
    with pytest.raises(UpstreamInvalid, match="routed_experts_layers and routed_experts_topk"):
        join([_piece(_flat(rows[:-1]), 0)], start=0, end=11, shape=RoutedShape(topk=2))  # 80 ids / 11
    with pytest.raises(UpstreamInvalid, match="routed_experts_topk"):
        join([_piece(_flat(rows), 0)], start=0, end=11, shape=RoutedShape())  # neither setting


def test_rows_must_have_the_settings_layers_and_topk() -> None:
    # vLLM's .npy carries its own shape: it must still be the model's
    raw = b'"' + vllm_payload(IDS, SPEC).encode() + b'"'
    assert join([_piece(raw, 3)], start=3, end=11, shape=RoutedShape(layers=4, topk=2)).shape == (8, 4, 2)
    with pytest.raises(UpstreamInvalid, match="the settings say"):
        join([_piece(raw, 3)], start=3, end=11, shape=RoutedShape(layers=5))
