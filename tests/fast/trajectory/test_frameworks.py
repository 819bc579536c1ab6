"""Field mappings from our training sample to verl, SkyRL, miles and slime.

Samples are built by hand as plain dicts (and once as an object): two assistant
turns with tool tokens between them and a closing repair token after the last one.
Every framework's field list is pinned literally here as well as in the module, so
changing either without the other fails.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from trajectory.errors import ExportError
from trajectory.frameworks import (
    MILES_SAMPLE_WIRE_FIELDS,
    MILES_WIRE_DTYPES,
    SKYRL_GENERATOR_OUTPUT_FIELDS,
    SLIME_SAMPLE_FIELDS,
    VERL_AGENT_LOOP_METRICS_FIELDS,
    VERL_AGENT_LOOP_OUTPUT_FIELDS,
    to_miles,
    to_skyrl,
    to_slime,
    to_verl,
)

PROMPT = [10, 11, 12]
OUT0 = [20, 21, 22]
TOOL = [30, 31]
OUT1 = [40, 41]
REPAIR = [99]
LP0 = [-0.5, -0.25, -1.0]
LP1 = [-2.0, -0.125]


def _sample(**over: Any) -> dict[str, Any]:
    """prompt | out0 (sampled) | tool (mask 0) | out1 (sampled) | repair (mask 0)."""
    ids = PROMPT + OUT0 + TOOL + OUT1 + REPAIR
    mask = [0] * 3 + [1] * 3 + [0] * 2 + [1] * 2 + [0]
    lp = [0.0] * 3 + LP0 + [0.0] * 2 + LP1 + [0.0]
    wv: list[Any] = [None] * 3 + ["3"] * 3 + [None] * 2 + ["3", "4"] + [None]
    sample = {
        "token_ids": np.array(ids, dtype=np.int32),
        "loss_mask": np.array(mask, dtype=np.uint8),
        "logprobs": np.array(lp, dtype=np.float32),
        "weight_version": wv,
        "turn_boundaries": [(0, 3, 6), (6, 8, 10)],
        "status": "completed",
        "reward": 1.5,
        "metadata": {"task": "t1"},
        "path": [0, 2],
    }
    sample.update(over)
    return sample


RESPONSE_ALL = OUT0 + TOOL + OUT1 + REPAIR
MASK_ALL = [1, 1, 1, 0, 0, 1, 1, 0]
LP_ALL = LP0 + [0.0, 0.0] + LP1 + [0.0]


def test_framework_field_lists_match_the_frameworks() -> None:
    assert VERL_AGENT_LOOP_OUTPUT_FIELDS == (
        "prompt_ids", "response_ids", "response_mask", "response_logprobs", "routed_experts",
        "multi_modal_data", "reward_score", "num_turns", "metrics", "extra_fields",
    )
    assert VERL_AGENT_LOOP_METRICS_FIELDS == ("generate_sequences", "tool_calls", "num_preempted")
    assert SKYRL_GENERATOR_OUTPUT_FIELDS == (
        "prompt_token_ids", "response_ids", "rewards", "loss_masks", "stop_reasons",
        "rollout_metrics", "rollout_logprobs", "trajectory_ids", "trajectory_generation_times",
        "trajectory_time_splits", "rollout_expert_indices", "is_last_step", "env_metrics",
        "pixel_values", "image_grid_thw",
    )
    assert MILES_SAMPLE_WIRE_FIELDS == (
        "tokens", "response", "response_length", "loss_mask", "rollout_log_probs",
        "rollout_routed_experts", "rollout_indexer_topk", "status", "weight_versions",
        "prefix_cache_info", "metadata", "reward",
    )
    assert {k: str(v) for k, v in MILES_WIRE_DTYPES.items()} == {
        "tokens": "int64", "loss_mask": "uint8", "rollout_log_probs": "float64",
        "rollout_routed_experts": "int32", "rollout_indexer_topk": "int32",
    }
    assert SLIME_SAMPLE_FIELDS == (
        "tokens", "response", "response_length", "reward", "loss_mask", "weight_versions",
        "rollout_log_probs", "status", "metadata",
    )


def _all_python(values: list[Any], kind: type) -> bool:
    return isinstance(values, list) and all(type(x) is kind for x in values)


def test_verl_agent_loop_output() -> None:
    out = to_verl(_sample())
    assert tuple(out) == VERL_AGENT_LOOP_OUTPUT_FIELDS
    assert tuple(out["metrics"]) == VERL_AGENT_LOOP_METRICS_FIELDS
    assert out["prompt_ids"] == PROMPT
    # verl keeps the whole tail: tool tokens and the closing token, both mask 0
    assert out["response_ids"] == RESPONSE_ALL
    assert out["response_mask"] == MASK_ALL
    assert out["response_logprobs"] == pytest.approx(LP_ALL)
    assert len(out["response_ids"]) == len(out["response_mask"]) == len(out["response_logprobs"])
    assert out["prompt_ids"] + out["response_ids"] == _sample()["token_ids"].tolist()
    assert _all_python(out["prompt_ids"] + out["response_ids"] + out["response_mask"], int)
    assert _all_python(out["response_logprobs"], float)
    assert out["reward_score"] == 1.5
    assert out["num_turns"] == 4  # prompt + 2 assistant turns + 1 tool turn
    assert out["extra_fields"] == {
        "status": "completed", "tree_path": [0, 2], "weight_versions": ["3", "4"],
        "metadata": {"task": "t1"}, "turn_scores": [None, None], "turn_lineage": [None, None],
    }


def test_verl_num_turns_single_turn_is_two() -> None:
    """verl's single-turn agent loop reports num_turns=2."""
    s = _sample(
        token_ids=np.array(PROMPT + OUT0, np.int32), loss_mask=np.array([0, 0, 0, 1, 1, 1], np.uint8),
        logprobs=np.array([0.0] * 3 + LP0, np.float32), weight_version=[None] * 3 + ["3"] * 3,
        turn_boundaries=[(0, 3, 6)],
    )
    assert to_verl(s)["num_turns"] == 2


def test_skyrl_generator_output_batch() -> None:
    short = _sample(
        token_ids=np.array(PROMPT + OUT0, np.int32), loss_mask=np.array([0, 0, 0, 1, 1, 1], np.uint8),
        logprobs=np.array([0.0] * 3 + LP0, np.float32), weight_version=[None] * 3 + ["3"] * 3,
        turn_boundaries=[(0, 3, 6)], status="truncated", reward=0.0,
    )
    out = to_skyrl([_sample(), short, _sample(status="aborted")])
    assert tuple(out) == SKYRL_GENERATOR_OUTPUT_FIELDS
    assert out["prompt_token_ids"] == [PROMPT, PROMPT, PROMPT]
    # SkyRL cuts the response right after the last generated token: no closing token
    assert out["response_ids"][0] == OUT0 + TOOL + OUT1
    assert out["loss_masks"][0] == MASK_ALL[:-1]
    assert out["rollout_logprobs"][0] == pytest.approx(LP_ALL[:-1])
    assert out["response_ids"][1] == OUT0 and out["loss_masks"][1] == [1, 1, 1]
    assert out["rewards"] == [1.5, 0.0, 1.5]
    assert out["stop_reasons"] == ["stop", "length", "abort"]
    # what skyrl's validate_generator_output checks
    for key in ("prompt_token_ids", "response_ids", "rewards", "loss_masks", "stop_reasons", "rollout_logprobs"):
        assert len(out[key]) == 3
    for ids, mask, lp in zip(out["response_ids"], out["loss_masks"], out["rollout_logprobs"], strict=True):
        assert len(ids) == len(mask) == len(lp)
        assert _all_python(ids + mask, int) and _all_python(lp, float)
    assert _all_python(out["rewards"], float)
    assert all(out[k] is None for k in SKYRL_GENERATOR_OUTPUT_FIELDS if k not in {
        "prompt_token_ids", "response_ids", "rewards", "loss_masks", "stop_reasons", "rollout_logprobs"})


def test_skyrl_needs_a_reward() -> None:
    with pytest.raises(ExportError, match="no reward"):
        to_skyrl([_sample(reward=None)])
    assert to_skyrl([_sample(reward=None)], default_reward=0.25)["rewards"] == [0.25]
    with pytest.raises(ExportError, match="at least one"):
        to_skyrl([])


def test_miles_wire_values() -> None:
    out = to_miles(_sample())
    assert tuple(out) == MILES_SAMPLE_WIRE_FIELDS
    for name, dtype in MILES_WIRE_DTYPES.items():
        assert out[name] is None or out[name].dtype == dtype, name
    assert out["tokens"].tolist() == PROMPT + OUT0 + TOOL + OUT1  # ends with the last output
    assert out["response_length"] == len(OUT0 + TOOL + OUT1) == 7
    assert len(out["loss_mask"]) == len(out["rollout_log_probs"]) == out["response_length"]
    assert out["tokens"][-out["response_length"]:].tolist() == OUT0 + TOOL + OUT1
    assert out["loss_mask"].tolist() == MASK_ALL[:-1]
    # float32 -> float64 is exact: the very same numbers
    assert out["rollout_log_probs"].tolist() == np.array(LP_ALL[:-1], np.float32).astype(np.float64).tolist()
    assert out["status"] == "completed"
    assert out["weight_versions"] == ["3", "4"]
    assert out["prefix_cache_info"] == {"cached_tokens": 0, "total_prompt_tokens": 0}
    assert out["metadata"] == {"task": "t1", "tree_path": [0, 2], "turn_rewards": [None, None],
                               "turn_lineage": [None, None]}
    assert out["reward"] == 1.5
    assert out["response"] == ""
    assert out["rollout_routed_experts"] is None and out["rollout_indexer_topk"] is None


def test_slime_sample_kwargs() -> None:
    out = to_slime(_sample(status="truncated"))
    assert tuple(out) == SLIME_SAMPLE_FIELDS
    assert out["tokens"] == PROMPT + OUT0 + TOOL + OUT1
    assert out["response_length"] == 7 == len(out["loss_mask"]) == len(out["rollout_log_probs"])
    assert out["loss_mask"] == MASK_ALL[:-1]
    assert out["rollout_log_probs"] == pytest.approx(LP_ALL[:-1])
    assert _all_python(out["tokens"] + out["loss_mask"], int) and _all_python(out["rollout_log_probs"], float)
    assert out["status"] == "truncated"
    assert out["weight_versions"] == ["3", "4"]
    assert out["metadata"] == {"task": "t1", "tree_path": [0, 2], "turn_rewards": [None, None],
                               "turn_lineage": [None, None]}


def test_split_uses_turns_not_mask() -> None:
    """Exactly-once masking may zero the first turn here (an earlier sample trains it):
    the prompt still ends at the first sampled position."""
    mask = np.array([0] * 3 + [0] * 3 + [0] * 2 + [1] * 2 + [0], np.uint8)
    lp = np.array([0.0] * 8 + LP1 + [0.0], np.float32)
    s = _sample(loss_mask=mask, logprobs=lp)
    v = to_verl(s)
    assert v["prompt_ids"] == PROMPT
    assert v["response_mask"] == [0, 0, 0, 0, 0, 1, 1, 0]
    m = to_miles(s)
    assert m["response_length"] == 7 and m["loss_mask"].tolist() == [0, 0, 0, 0, 0, 1, 1]
    assert to_skyrl([s])["prompt_token_ids"] == [PROMPT]


def test_object_samples_work_like_dicts() -> None:
    d = _sample()
    obj = SimpleNamespace(**d)
    assert to_verl(obj) == to_verl(d)
    assert to_slime(obj) == to_slime(d)


def test_empty_sample_is_all_prompt() -> None:
    """A sample returned empty (first turn over max_seq_len) maps to empty sequences."""
    s = _sample(
        token_ids=np.empty(0, np.int32), loss_mask=np.empty(0, np.uint8), logprobs=np.empty(0, np.float32),
        weight_version=[], turn_boundaries=[], status="truncated", reward=None,
    )
    v = to_verl(s)
    assert v["prompt_ids"] == v["response_ids"] == v["response_mask"] == v["response_logprobs"] == []
    assert v["num_turns"] == 0
    m = to_miles(s)
    assert m["response_length"] == 0 and m["tokens"].dtype == np.int64 and len(m["tokens"]) == 0
    assert m["weight_versions"] == []


def test_weight_versions_skip_unknown_and_empty_turns() -> None:
    s = _sample(
        weight_version=[None] * 3 + [None] * 3 + [None] * 2 + [7, 8] + [None],
        turn_boundaries=[(0, 3, 6), (6, 8, 10)],
    )
    assert to_miles(s)["weight_versions"] == ["8"]


@pytest.mark.parametrize(
    ("over", "match"),
    [
        ({"status": "pending"}, "status"),
        ({"loss_mask": np.array([0] * 10, np.uint8)}, "10 entries for 11"),
        ({"weight_version": [None]}, "1 entries"),
        ({"turn_boundaries": [(0, 6, 3)]}, "out of order"),
        ({"turn_boundaries": [(0, 3, 6), (5, 8, 10)]}, "out of order"),
        ({"turn_boundaries": [(0, 3, 6), (6, 8, 12)]}, "out of order"),
        ({"turn_boundaries": [(0, 3, 6)]}, r"loss_mask\[8\]"),
        ({"loss_mask": np.array([0, 0, 0, 2, 1, 1, 0, 0, 1, 1, 0], np.int64)}, r"loss_mask\[3\] = 2"),
        ({"loss_mask": np.array([0, 0, 0, 1, 1, 1, 0, 0, 1, 1, -1])}, "uint8"),
        ({"token_ids": np.array([1.5] * 11)}, "int32"),
        ({"token_ids": np.zeros((11, 1), np.int32)}, "one-dimensional"),
        ({"turn_boundaries": [(0, 3)]}, "triples"),
    ],
)
def test_malformed_samples_raise_export_error(over: dict[str, Any], match: str) -> None:
    for fn in (to_verl, to_miles, to_slime, lambda s: to_skyrl([s])):
        with pytest.raises(ExportError, match=match):
            fn(_sample(**over))


def test_missing_field_is_typed() -> None:
    d = _sample()
    del d["path"]
    with pytest.raises(ExportError, match="'path'"):
        to_verl(d)
    with pytest.raises(ExportError, match="'path'"):
        to_verl(SimpleNamespace(**d))


def test_per_turn_rewards_reach_every_mapping_under_its_own_name() -> None:
    s = _sample(turn_rewards=[0.25, None])
    assert to_verl(s)["extra_fields"]["turn_scores"] == [0.25, None]
    assert to_miles(s)["metadata"]["turn_rewards"] == [0.25, None]
    assert to_slime(s)["metadata"]["turn_rewards"] == [0.25, None]
    assert to_miles(s)["reward"] == to_slime(s)["reward"] == 1.5  # the trajectory-level reward as it was
    # SkyRL's token-level form: the response is out0 | tool | out1 (tail cut); turn 0's reward on
    # out0's last token, turn 1 has none, the trajectory reward on the last response token
    out = to_skyrl([s, _sample(reward=-1.0)])
    assert out["rewards"] == [[0.0, 0.0, 0.25, 0.0, 0.0, 0.0, 1.5], [0.0] * 6 + [-1.0]]
    assert [len(r) for r in out["rewards"]] == [len(r) for r in out["response_ids"]]
    assert to_skyrl([_sample(reward=None, turn_rewards=[None, 2.0])])["rewards"] == [[0.0] * 6 + [2.0]]
    assert to_skyrl([_sample()])["rewards"] == [1.5]  # no turn reward anywhere: one float per row
    with pytest.raises(ExportError, match="sample 1 has no reward"):
        to_skyrl([s, _sample(reward=None)])
    with pytest.raises(ExportError, match="turn_rewards has 1 entries for 2 turns"):
        to_verl(_sample(turn_rewards=[1.0]))


def test_each_turns_lineage_reaches_verl_miles_and_slime_as_turn_lineage() -> None:
    main = {"agent": "main", "kind": "main", "thread": "t", "parent": None, "source": "x-tito-agent"}
    s = _sample(turn_lineage=[main, None])
    assert to_verl(s)["extra_fields"]["turn_lineage"] == [main, None]
    assert to_miles(s)["metadata"]["turn_lineage"] == [main, None]
    assert to_slime(s)["metadata"]["turn_lineage"] == [main, None]
    assert to_verl(_sample())["extra_fields"]["turn_lineage"] == [None, None]  # absent: unknown per turn
    with pytest.raises(ExportError, match="turn_lineage has 1 entries for 2 turns"):
        to_miles(_sample(turn_lineage=[main]))
    with pytest.raises(ExportError, match="turn_lineage: not a lineage"):
        to_slime(_sample(turn_lineage=[{"agent": "main", "kind": "boss"}, None]))


def test_each_turns_recorded_sampling_reaches_verl_miles_and_slime() -> None:
    """A trainer reads how each turn was sampled where the framework keeps per-sample extras:
    verl's extra_fields, miles' and slime's metadata; a turn that recorded none is None."""
    pinned = {"policy": "pinned", "engine": {"temperature": 1.0, "max_tokens": 64},
              "client": {"temperature": 0.0}, "overridden": ["temperature"], "seeds": [5, 6]}
    sample = _sample(diagnostics=[{"turn": 0, "sampling": pinned}, {"turn": 1}])
    want = [pinned, None]
    assert to_verl(sample)["extra_fields"]["turn_sampling"] == want
    assert to_miles(sample)["metadata"]["turn_sampling"] == want
    assert to_slime(sample)["metadata"]["turn_sampling"] == want
    assert to_slime(SimpleNamespace(**sample))["metadata"]["turn_sampling"] == want
    # nothing recorded: the mappings are as they were
    assert "turn_sampling" not in to_verl(_sample(diagnostics=[{}, {}]))["extra_fields"]
    with pytest.raises(ExportError, match="diagnostics"):
        to_verl(_sample(diagnostics=[{"sampling": pinned}]))
