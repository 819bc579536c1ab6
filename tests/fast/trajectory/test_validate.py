"""validate_generation: every strict check names its field and index; good results pass."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trajectory.errors import ValidationError
from trajectory.validate import SENTINEL_FLOOR, Expectations, validate_generation

VOCAB = 1000
EOS = 999


@dataclass(frozen=True)
class FakeResult:
    """Duck-typed stand-in for session_server's GenerateResult."""

    request_id: Any = "rid-0001"
    output_ids: Any = (5, 6, EOS)
    logprobs: Any = (-0.5, -1.25, 0.0)
    finish_reason: Any = "stop"
    matched_stop: Any = EOS
    prompt_tokens: Any = 10
    completion_tokens: Any = 3
    cached_tokens: Any = 4
    weight_version: Any = "3"
    output_ids_echo: Any = None


EXPECT = Expectations(
    request_id="rid-0001",
    prompt_len=10,
    vocab_size=VOCAB,
    max_tokens=8,
    stop_token_ids=frozenset({EOS}),
    last_weight_version="2",
)


def good(**changes: Any) -> FakeResult:
    return dataclasses.replace(FakeResult(), **changes)


def test_accepts_well_formed() -> None:
    v = validate_generation(good(output_ids=[5, 6, EOS], logprobs=[-0.5, -1.25, 0]), EXPECT)
    assert v.ids.dtype == np.int32 and v.ids.tolist() == [5, 6, EOS]
    assert v.logprobs.dtype == np.float32 and v.logprobs.tolist() == [-0.5, -1.25, 0.0]
    assert (
        v.finish_reason,
        v.matched_stop,
        v.prompt_tokens,
        v.completion_tokens,
        v.cached_tokens,
    ) == (
        "stop",
        EOS,
        10,
        3,
        4,
    )
    assert v.weight_version == "3" and v.clamped == 0 and v.request_id == "rid-0001"


def test_accepts_the_real_generate_result() -> None:
    from session_server.engines.base import GenerateResult

    r = GenerateResult(
        request_id="rid-0001",
        output_ids=[1, 2],
        logprobs=[-0.1, -0.2],
        finish_reason="abort",
        matched_stop=None,
        prompt_tokens=10,
        completion_tokens=2,
        cached_tokens=0,
        output_ids_echo=[1, 2],
    )
    assert validate_generation(r, EXPECT).ids.tolist() == [1, 2]


def _lp(bad: Any, at: int = 1) -> list:
    lps: list[Any] = [-0.5, -1.25, 0.0]
    lps[at] = bad
    return lps


def _ids(bad: Any, at: int = 1) -> list:
    ids: list[Any] = [5, 6, EOS]
    ids[at] = bad
    return ids


CASES = [
    pytest.param(good(output_ids=_ids(True)), EXPECT, "output_ids", 1, id="bool-id"),
    pytest.param(
        good(output_ids=_ids(np.bool_(True))), EXPECT, "output_ids", 1, id="numpy-bool-id"
    ),
    pytest.param(good(output_ids=_ids(6.0)), EXPECT, "output_ids", 1, id="float-id"),
    pytest.param(good(output_ids=_ids("6")), EXPECT, "output_ids", 1, id="str-id"),
    pytest.param(good(output_ids=_ids(None)), EXPECT, "output_ids", 1, id="none-id"),
    pytest.param(good(output_ids=_ids(-1)), EXPECT, "output_ids", 1, id="negative-id"),
    pytest.param(good(output_ids=_ids(VOCAB)), EXPECT, "output_ids", 1, id="oov-id"),
    pytest.param(good(output_ids=_ids(2**70, 0)), EXPECT, "output_ids", 0, id="huge-id"),
    pytest.param(good(output_ids="abc"), EXPECT, "output_ids", None, id="ids-string"),
    pytest.param(
        good(output_ids=np.array([1.0, 2.0, 3.0])), EXPECT, "output_ids", None, id="float-array"
    ),
    pytest.param(good(logprobs=_lp(float("nan"))), EXPECT, "logprobs", 1, id="nan"),
    pytest.param(good(logprobs=_lp(float("inf"))), EXPECT, "logprobs", 1, id="+inf"),
    pytest.param(good(logprobs=_lp(float("-inf"), 2)), EXPECT, "logprobs", 2, id="-inf"),
    pytest.param(good(logprobs=_lp(0.01)), EXPECT, "logprobs", 1, id="positive"),
    pytest.param(good(logprobs=_lp("-0.5")), EXPECT, "logprobs", 1, id="str-logprob"),
    pytest.param(good(logprobs=_lp(False, 0)), EXPECT, "logprobs", 0, id="bool-logprob"),
    pytest.param(good(logprobs=_lp(None)), EXPECT, "logprobs", 1, id="none-logprob"),
    pytest.param(good(logprobs=_lp(-9999.0)), EXPECT, "logprobs", 1, id="sentinel"),
    pytest.param(good(logprobs=_lp(-1e39)), EXPECT, "logprobs", 1, id="beyond-float32"),
    pytest.param(good(logprobs=_lp(-(10**400))), EXPECT, "logprobs", 1, id="huge-int-logprob"),
    pytest.param(good(logprobs=[-0.5, -1.25]), EXPECT, "logprobs", None, id="fewer-logprobs"),
    pytest.param(
        good(logprobs=[-0.5, -1.25, 0.0, -1.0]), EXPECT, "logprobs", None, id="more-logprobs"
    ),
    pytest.param(
        good(completion_tokens=4), EXPECT, "completion_tokens", None, id="completion-mismatch"
    ),
    pytest.param(
        good(completion_tokens=True), EXPECT, "completion_tokens", None, id="completion-bool"
    ),
    pytest.param(
        good(completion_tokens=3.0), EXPECT, "completion_tokens", None, id="completion-float"
    ),
    pytest.param(good(prompt_tokens=11), EXPECT, "prompt_tokens", None, id="prompt-mismatch"),
    pytest.param(good(prompt_tokens="10"), EXPECT, "prompt_tokens", None, id="prompt-str"),
    pytest.param(good(cached_tokens=11), EXPECT, "cached_tokens", None, id="cached-above-prompt"),
    pytest.param(good(cached_tokens=-1), EXPECT, "cached_tokens", None, id="cached-negative"),
    pytest.param(good(cached_tokens=False), EXPECT, "cached_tokens", None, id="cached-bool"),
    pytest.param(
        good(output_ids_echo=[5, 7, EOS]), EXPECT, "output_ids_echo", 1, id="echo-differs"
    ),
    pytest.param(good(output_ids_echo=[5, 6]), EXPECT, "output_ids_echo", 2, id="echo-shorter"),
    pytest.param(
        good(output_ids_echo=[5, True, EOS]), EXPECT, "output_ids_echo", 1, id="echo-bool"
    ),
    pytest.param(
        good(finish_reason="length"), EXPECT, "finish_reason", None, id="length-under-budget"
    ),
    pytest.param(good(finish_reason="eos"), EXPECT, "finish_reason", None, id="unknown-finish"),
    pytest.param(
        good(finish_reason="abort"),
        dataclasses.replace(EXPECT, max_tokens=2),
        "output_ids",
        2,
        id="over-budget",
    ),
    pytest.param(good(matched_stop=6), EXPECT, "matched_stop", None, id="stop-match-not-last"),
    pytest.param(good(matched_stop=True), EXPECT, "matched_stop", None, id="stop-match-bool"),
    pytest.param(good(matched_stop=1.5), EXPECT, "matched_stop", None, id="stop-match-float"),
    pytest.param(
        good(matched_stop=None, output_ids=[5, 6, 7]),
        EXPECT,
        "finish_reason",
        None,
        id="stop-without-stop-token",
    ),
    pytest.param(
        good(output_ids=[], logprobs=[], completion_tokens=0),
        EXPECT,
        "matched_stop",
        None,
        id="stop-empty",
    ),
    pytest.param(good(request_id="rid-0002"), EXPECT, "request_id", None, id="request-id"),
    pytest.param(good(request_id=None), EXPECT, "request_id", None, id="request-id-missing"),
    pytest.param(good(weight_version="1"), EXPECT, "weight_version", None, id="version-backwards"),
    pytest.param(
        good(weight_version=1.5), EXPECT, "weight_version", None, id="version-backwards-float"
    ),
    pytest.param(good(weight_version=[3]), EXPECT, "weight_version", None, id="version-list"),
    pytest.param(
        good(weight_version=float("nan")), EXPECT, "weight_version", None, id="version-nan"
    ),
]


@pytest.mark.parametrize(("result", "expect", "field", "index"), CASES)
def test_rejects(result: FakeResult, expect: Expectations, field: str, index: int | None) -> None:
    with pytest.raises(ValidationError) as info:
        validate_generation(result, expect)
    assert (info.value.field, info.value.index) == (field, index), str(info.value)


def test_sentinel_clamped_when_configured() -> None:
    expect = dataclasses.replace(EXPECT, clamp_sentinel=True)
    v = validate_generation(good(logprobs=[-9999.0, -1.0, -9999.0]), expect)
    assert v.clamped == 2 and v.logprobs.tolist() == [SENTINEL_FLOOR, -1.0, SENTINEL_FLOOR]


@pytest.mark.parametrize(
    ("version", "last"),
    [
        pytest.param("3", "3", id="same"),
        pytest.param("10", "9", id="numeric-not-lexicographic"),
        pytest.param(4, "3.5", id="mixed-numeric"),
        pytest.param("abc", "xyz", id="opaque"),
        pytest.param(None, "5", id="unreported"),
        pytest.param("1", None, id="first"),
    ],
)
def test_weight_versions_accepted(version: Any, last: Any) -> None:
    expect = dataclasses.replace(EXPECT, last_weight_version=last)
    assert validate_generation(good(weight_version=version), expect).weight_version == version


def test_finish_variants_accepted() -> None:
    assert validate_generation(good(matched_stop=None), EXPECT).matched_stop is None
    assert (
        validate_generation(good(matched_stop="</s>", output_ids=[5, 6, 7]), EXPECT).matched_stop
        == "</s>"
    )
    assert validate_generation(good(matched_stop=np.int64(EOS)), EXPECT).matched_stop == EOS
    full = good(
        finish_reason="length",
        matched_stop=None,
        output_ids=[1] * 8,
        logprobs=[-1.0] * 8,
        completion_tokens=8,
    )
    assert validate_generation(full, EXPECT).finish_reason == "length"
    empty_abort = good(
        finish_reason="abort", matched_stop=None, output_ids=[], logprobs=[], completion_tokens=0
    )
    assert validate_generation(empty_abort, EXPECT).ids.shape == (0,)


@settings(max_examples=150, deadline=None)
@given(
    st.lists(st.integers(0, VOCAB - 1), max_size=40).flatmap(
        lambda ids: st.tuples(
            st.just(ids),
            st.lists(
                st.one_of(st.floats(-1e4, 1e-6, allow_nan=False), st.integers(-100, 0)),
                min_size=len(ids),
                max_size=len(ids),
            ).filter(lambda lps: -9999.0 not in lps),
            st.sampled_from(["stop", "length", "abort"]),
            st.integers(0, 10),
            st.booleans(),
        )
    )
)
def test_accepts_generated_well_formed(case: tuple) -> None:
    ids, lps, finish, cached, echo = case
    n = len(ids)
    matched = None
    if finish == "stop":
        ids = [*ids, EOS]
        lps = [*lps, -0.1]
        n += 1
        matched = EOS if echo else None
    expect = dataclasses.replace(EXPECT, max_tokens=n if finish == "length" else n + 3)
    r = good(
        output_ids=ids,
        logprobs=lps,
        finish_reason=finish,
        matched_stop=matched,
        completion_tokens=n,
        cached_tokens=cached,
        output_ids_echo=list(ids) if echo else None,
    )
    v = validate_generation(r, expect)
    assert v.ids.tolist() == ids
    assert v.logprobs.tolist() == [float(np.float32(x)) for x in lps]


def test_validates_10k_tokens_exactly() -> None:
    """A 10K-token turn is checked whole (its speed is measured in bench/, not asserted here)."""
    n = 10_000
    ids = [i % VOCAB for i in range(n - 1)] + [EOS]
    r = good(output_ids=ids, logprobs=[-0.5] * n, completion_tokens=n, output_ids_echo=ids)
    expect = dataclasses.replace(EXPECT, max_tokens=n)
    v = validate_generation(r, expect)
    assert v.ids.tolist() == ids and len(v.logprobs) == n
    bad = good(output_ids=ids, logprobs=[-0.5] * (n - 1) + [0.5], completion_tokens=n, output_ids_echo=ids)
    with pytest.raises(ValidationError):
        validate_generation(bad, expect)


def test_unreported_counters_are_accepted_but_reported_ones_are_exact() -> None:
    """Some vLLM versions omit `usage`: None means "not reported", not zero."""
    v = validate_generation(good(cached_tokens=None, prompt_tokens=None), EXPECT)
    assert v.cached_tokens == 0
    assert v.prompt_tokens == EXPECT.prompt_len
