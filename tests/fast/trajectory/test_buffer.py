"""TokenBuffer: equals a list model under random appends/truncates, stays compact."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trajectory.buffer import BYTES_PER_TOKEN_BOUND, TokenBuffer
from trajectory.errors import InvariantError

_batch = st.lists(
    st.tuples(
        st.integers(0, 2**31 - 1),
        st.floats(-50.0, 0.0, width=32, allow_nan=False),
        st.integers(0, 1),
    ),
    max_size=40,
)
_op = st.one_of(
    st.tuples(st.just("append"), _batch),
    st.tuples(st.just("truncate"), st.floats(0.0, 1.0)),
)


@settings(max_examples=200, deadline=None)
@given(st.lists(_op, max_size=30))
def test_buffer_equals_list_model(ops: list) -> None:
    buf, model = TokenBuffer(), []
    for kind, arg in ops:
        if kind == "append":
            ids = [a for a, _, _ in arg]
            lps = np.array([b for _, b, _ in arg], dtype=np.float32)
            mask = np.array([c for _, _, c in arg], dtype=np.uint8)
            buf.append(ids, lps, mask)
            model.extend(arg)
        else:
            n = int(arg * len(model))
            buf.truncate(n)
            del model[n:]
        assert len(buf) == len(model)
        assert buf.ids.tolist() == [a for a, _, _ in model]
        assert buf.logprobs.tolist() == [float(np.float32(b)) for _, b, _ in model]
        assert buf.mask.tolist() == [c for _, _, c in model]
        assert buf.bytes_per_token() <= BYTES_PER_TOKEN_BOUND or len(buf) == 0
    k = 7
    assert buf.tail(k) == [a for a, _, _ in model][-k:]


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(1, 5000), min_size=1, max_size=200))
def test_bytes_per_token_bounded_after_many_appends(sizes: list[int]) -> None:
    buf = TokenBuffer()
    for size in sizes:
        buf.append(np.arange(size, dtype=np.int32), None, 0)
        assert buf.bytes_per_token() <= BYTES_PER_TOKEN_BOUND
    assert buf.capacity <= 1.25 * len(buf)
    assert buf.nbytes == buf.capacity * 9


def test_growth_is_amortised() -> None:
    buf = TokenBuffer()
    reallocs, last_cap = 0, 0
    for _ in range(20_000):
        buf.append([1, 2, 3], [-0.5, -0.5, -0.5], 1)
        if buf.capacity != last_cap:
            reallocs, last_cap = reallocs + 1, buf.capacity
    assert len(buf) == 60_000
    assert reallocs < 60  # geometric growth: O(log n) reallocations


def test_views_are_read_only() -> None:
    buf = TokenBuffer()
    buf.append([5, 6], [-1.0, -2.0], [1, 1])
    for view in (buf.ids, buf.logprobs, buf.mask):
        with pytest.raises(ValueError):
            view[0] = 0
    assert (
        buf.ids.dtype == np.int32
        and buf.logprobs.dtype == np.float32
        and buf.mask.dtype == np.uint8
    )


def test_scalar_mask_and_default_logprobs() -> None:
    buf = TokenBuffer()
    buf.append([1, 2, 3])
    assert buf.mask.tolist() == [0, 0, 0] and buf.logprobs.tolist() == [0.0, 0.0, 0.0]


def test_shape_mismatch_changes_nothing() -> None:
    buf = TokenBuffer()
    buf.append([1, 2])
    with pytest.raises(InvariantError):
        buf.append([3, 4], [-1.0], 1)
    with pytest.raises(InvariantError):
        buf.append([3, 4], None, [1, 1, 1])
    with pytest.raises(InvariantError):
        buf.append([[3, 4]])
    assert buf.ids.tolist() == [1, 2]


def test_truncate_and_copy_prefix() -> None:
    buf = TokenBuffer()
    buf.append(list(range(100)), np.full(100, -0.5, dtype=np.float32), 1)
    copy = buf.copy_prefix(40)
    assert copy.ids.tolist() == list(range(40)) and copy.capacity == 40
    buf.truncate(10)
    assert buf.ids.tolist() == list(range(10))
    assert buf.bytes_per_token() <= BYTES_PER_TOKEN_BOUND
    assert copy.ids.tolist() == list(range(40))  # independent storage
    with pytest.raises(InvariantError):
        buf.truncate(11)
    with pytest.raises(InvariantError):
        buf.copy_prefix(-1)
    buf.truncate(0)
    assert len(buf) == 0 and buf.bytes_per_token() == 0.0 and buf.tail(3) == []


def test_from_arrays_round_trip() -> None:
    buf = TokenBuffer.from_arrays(
        np.array([1, 2], dtype=np.int32),
        np.array([0.0, -1.5], dtype=np.float32),
        np.array([0, 1], dtype=np.uint8),
    )
    assert (
        buf.ids.tolist() == [1, 2]
        and buf.logprobs.tolist() == [0.0, -1.5]
        and buf.mask.tolist() == [0, 1]
    )
