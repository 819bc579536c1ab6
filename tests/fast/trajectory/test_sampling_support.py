"""Sampling support as CSR: its round trips (lists, joins of segments, a line of turns,
every sample format and batch writer, miles' wire) and the two read-out rules."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trajectory.errors import ValidationError
from trajectory.frameworks import to_miles
from trajectory.linear import LinearTrajectory
from trajectory.sample_batch import BATCH_WRITERS
from trajectory.sample_formats import (
    SERIALIZERS,
    load_samples_json,
    load_samples_npz,
    load_samples_safetensors,
)
from trajectory.samples import build_samples
from trajectory.support import SupportCSR, SupportSampling, concat, line_support, support_from_tops
from trajectory.tree import TrajectoryTree

rows_st = st.lists(st.lists(st.integers(0, 150_000), max_size=20), max_size=30)
LOADERS = {"json": load_samples_json, "npz": load_samples_npz, "safetensors": load_samples_safetensors}


@given(rows=rows_st)
def test_rows_round_trip_through_csr_within_4k_plus_4_bytes_a_token(rows: list[list[int]]) -> None:
    csr = SupportCSR.from_lists(rows)
    assert csr.to_lists() == rows
    assert csr.ids.dtype == np.int32 and csr.offsets.dtype == np.int32
    assert csr.nbytes == 4 * sum(map(len, rows)) + 4 * (len(rows) + 1)
    assert csr.nbytes <= len(rows) * (4 * 20 + 4) + 4  # k = 20


@given(parts=st.lists(rows_st, max_size=5), cut=st.floats(0, 1))
def test_segments_join_to_the_rows_of_the_whole_turn(parts: list[list[list[int]]], cut: float) -> None:
    joined = concat([SupportCSR.from_lists(p) for p in parts])
    whole = [r for p in parts for r in p]
    assert joined.to_lists() == whole
    at = int(cut * len(whole))
    assert joined.slice(0, at).to_lists() + joined.slice(at, len(whole)).to_lists() == whole


def _tree_with_supports(turns: list[tuple[list[int], list[list[int]]]]) -> TrajectoryTree:
    tree = TrajectoryTree()
    traj: LinearTrajectory = tree.active.trajectory
    for prompt, support in turns:
        sampled = [r[0] for r in support]
        traj.commit_turn(prompt, sampled, [-0.5] * len(sampled), finish_reason="stop", repair_ids=[7],
                         sampling_support=SupportCSR.from_lists(support))
    return tree


turns_st = st.lists(
    st.tuples(st.lists(st.integers(0, 999), min_size=1, max_size=6),
              st.lists(st.lists(st.integers(0, 999), min_size=1, max_size=5), min_size=1, max_size=6)),
    min_size=1, max_size=4)


@settings(max_examples=40, deadline=None)
@given(turns=turns_st)
def test_samples_carry_each_tokens_support_through_every_format(turns: list[tuple[list[int], list[list[int]]]]) -> None:
    tree = _tree_with_supports(turns)
    [sample] = build_samples(tree)
    sup = sample.sampling_support
    assert sup is not None and len(sup) == len(sample)
    for (_, support), (_, o, e) in zip(turns, sample.turn_boundaries, strict=True):
        assert [sup.row(i).tolist() for i in range(o, e)] == support
    assert sum(len(sup.row(i)) for i in range(len(sample)) if not sample.loss_mask[i]) == 0
    for fmt, dump in SERIALIZERS.items():
        [back] = LOADERS[fmt](dump([sample, sample]))[:1]
        assert back.sampling_support is not None and back.sampling_support.to_lists() == sup.to_lists(), fmt
        writer = BATCH_WRITERS[fmt]()
        try:
            streamed = writer.head() + writer.add([sample]) + writer.add([sample]) + b"".join(writer.chunks())
        finally:
            writer.close()
        got = LOADERS[fmt](streamed)
        assert [s.sampling_support.to_lists() for s in got if s.sampling_support] == [sup.to_lists()] * 2, fmt
    miles = to_miles(sample)
    s, e = sample.turn_boundaries[0][1], sample.turn_boundaries[-1][2]
    off, ids = miles["rollout_sampling_mask_offsets"], miles["rollout_sampling_mask_ids"]
    assert ids.dtype == np.int32 and off.dtype == np.int64 and len(off) == miles["response_length"] + 1 == e - s + 1
    for j in range(e - s):  # sampled tokens their support, forced ones their own id alone (miles' rule)
        row = ids[off[j] : off[j + 1]].tolist()
        assert row == (sup.row(s + j).tolist() if sample.loss_mask[s + j] else [int(sample.token_ids[s + j])])


def test_a_sample_without_support_has_no_support_fields() -> None:
    tree = TrajectoryTree()
    tree.active.trajectory.commit_turn([1, 2], [3], [-0.1], finish_reason="stop")
    [sample] = build_samples(tree)
    assert sample.sampling_support is None and line_support(tree.active.trajectory.turns, 3) is None
    assert "rollout_sampling_mask_ids" not in to_miles(sample)
    for fmt, dump in SERIALIZERS.items():
        assert LOADERS[fmt](dump([sample]))[0].sampling_support is None


def test_processed_rule_keeps_the_ids_above_vllms_floor() -> None:
    tops = [[(5, -0.1), (9, -2.0), (4, -9999.0)], [(8, -0.3), (5, -9999.0), (6, -9999.0)]]
    got = support_from_tops(tops, [9, 8], rule="processed", sampling=SupportSampling(top_k=2))
    assert got.to_lists() == [[5, 9], [8]]


def test_post_temperature_rule_replays_sglangs_truncation() -> None:
    lp = np.log([0.5, 0.3, 0.15, 0.05]).tolist()
    tops = [list(zip([1, 2, 3, 4], lp, strict=True))]
    rule = "post_temperature"
    assert support_from_tops(tops, [1], rule=rule, sampling=SupportSampling(top_k=3)).to_lists() == [[1, 2, 3]]
    assert support_from_tops(tops, [1], rule=rule, sampling=SupportSampling(top_k=4, top_p=0.7)).to_lists() == [[1, 2]]
    assert support_from_tops(tops, [1], rule=rule, sampling=SupportSampling(top_k=4, min_p=0.5)).to_lists() == [[1, 2]]


@pytest.mark.parametrize(("tops", "sampled", "what"), [
    ([[(5, -0.1), (9, -9999.0)]], [9], "outside its support"),
    ([[(5, -0.1), (9, -0.2), (4, -0.3)]], [5], "larger than top_k"),
    ([], [5], "top-logprob lists"),
])
def test_a_support_without_the_sampled_token_or_over_top_k_is_bad_engine_output(
    tops: list, sampled: list[int], what: str,  # type: ignore[type-arg]
) -> None:
    with pytest.raises(ValidationError, match=what):
        support_from_tops(tops, sampled, rule="processed", sampling=SupportSampling(top_k=2))


def test_ids_tied_with_the_top_k_th_stay_in_the_support_as_vllm_keeps_them() -> None:
    """vLLM's top-k masks only logits below the k-th: bf16 ties at the k-th all stay."""
    tops = [[(5, -0.5), (9, -1.5), (4, -1.5), (3, -9999.0)]]
    got = support_from_tops(tops, [4], rule="processed", sampling=SupportSampling(top_k=2), asked=4)
    assert got.to_lists() == [[5, 9, 4]]
    with pytest.raises(ValidationError, match="ask a larger k"):  # the ties fill every logprob asked
        support_from_tops([[(5, -0.5), (9, -1.5), (4, -1.5)]], [4], rule="processed",
                          sampling=SupportSampling(top_k=2), asked=3)


def test_trajectory_export_keeps_each_turns_sampling_support() -> None:
    """The trajectory export (JSON and npz) carries every turn field, routed experts
    included: a trainer building samples from an export must get the same supports as
    one building them from the live tree."""
    from trajectory.export import from_dict, from_npz_bytes, to_dict, to_npz_bytes

    tree = _tree_with_supports([([1, 2], [[5, 6], [7]]), ([3], [[8, 9, 10]])])
    [live] = build_samples(tree)
    assert live.sampling_support is not None
    for name, back in (("json", from_dict(to_dict(tree))), ("npz", from_npz_bytes(to_npz_bytes(tree)))):
        turns = back.active.trajectory.turns
        assert [None if t.sampling_support is None else t.sampling_support.to_lists() for t in turns] == [
            [[5, 6], [7]], [[8, 9, 10]]], name
        [sample] = build_samples(back)
        assert sample.sampling_support is not None, name
        assert sample.sampling_support.to_lists() == live.sampling_support.to_lists(), name


def test_to_miles_refuses_a_support_that_does_not_cover_the_sample_as_an_export_error() -> None:
    """The mappings read any object with the sample's fields and refuse a malformed one
    with `ExportError` (framework_view checks every other field's length): a support
    with fewer rows than tokens must be refused the same way, not crash mid-mapping."""
    from trajectory.errors import ExportError

    [sample] = build_samples(_tree_with_supports([([1, 2], [[5, 6], [7]])]))
    assert sample.sampling_support is not None
    sample.sampling_support = sample.sampling_support.slice(0, len(sample) - 2)
    with pytest.raises(ExportError):
        to_miles(sample)
