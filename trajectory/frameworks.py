"""Field mappings from our training sample to the sample formats RL frameworks consume.

Plain dicts, lists and numpy arrays only: no framework is imported, so an RL worker
can build the framework's own object from the dict (``AgentLoopOutput(**d)``,
``Sample(**d)``) without this library depending on verl, SkyRL, slime or miles.

Our sample (``trajectory.samples``) is read through a small accessor (``trajectory.framework_view``), so any object
with these attributes, or any mapping with these keys, works:

    token_ids        int32 [T]      the whole sequence
    loss_mask        uint8 [T]      1 on tokens this sample trains (exactly-once: a
                                    sampled token shared with an earlier sample is 0)
    logprobs         float32 [T]    0.0 where the mask is 0
    weight_version   [T]            per-token weight version (None off sampled tokens)
    turn_boundaries  [(prompt_start, output_start, output_end)] per turn
    status           'completed' | 'truncated' | 'aborted'
    reward           float | None
    turn_rewards     [float | None] per turn (optional; `trajectory.turn_rewards`)
    turn_lineage     [dict | None] per turn (optional; `trajectory.lineage`: agent, kind,
                                    thread, parent, source of who asked for the turn)
    metadata         dict
    path             list[int]      the leaf's path in the branch tree
    diagnostics      [dict] per turn (optional): each turn's ``sampling`` is carried
                                    as ``turn_sampling`` (below)

**Per-turn sampling** (``turn_sampling``, present when some turn recorded it: one entry
per turn, the turn's recorded ``sampling`` or None): the temperature, top_p, ... and seeds the engine was sent for
that turn, and what the client had asked. A trainer that recomputes logprobs at the
sampling temperature, or drops turns a harness sampled at its own, reads it here:
verl's ``extra_fields``, miles' and slime's ``metadata``; SkyRL's ``GeneratorOutput``
has no per-row field for it (its ``rollout_metrics`` is one dict per batch).

**The prompt/response split** (the same for every framework): the prompt is every
token before the first turn's ``output_start``, the first sampled position; the
response is everything from there on, so tool/user/template tokens between turns
sit inside the response with mask 0 and logprob 0.0 (the convention of all four
frameworks, cited below). The split uses the turn boundaries, not the mask: under
exactly-once masking the first sampled tokens may have mask 0 in this sample (an
earlier sample trains them) and must not move the boundary. A sample without turns
(e.g. returned empty by ``max_seq_len``) is all prompt, with an empty response.

**Where the response ends** differs: verl's tool agent loop keeps whatever the loop
appended last (so we keep every token); SkyRL's generator cuts the response right
after the last generated token, and miles' merged sample ends with the last turn's
output, as does a slime sample built from session turns, so for those three we drop
the trailing mask-0 tokens after the last turn's ``output_end`` (the closing tokens
the server appended to a turn that stopped without sampling them). Nothing trainable
is ever dropped.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from trajectory.errors import ExportError
from trajectory.framework_view import sample_view, turn_sampling_field
from trajectory.support import miles_sampling_mask

# --- verl ---------------------------------------------------------------------------
VERL_AGENT_LOOP_OUTPUT_FIELDS = (
    "prompt_ids",
    "response_ids",
    "response_mask",
    "response_logprobs",
    "routed_experts",
    "multi_modal_data",
    "reward_score",
    "num_turns",
    "metrics",
    "extra_fields",
)
"""`AgentLoopOutput` (pydantic), volcengine/verl@b178a3cd56f58b2d502255daba591e92833930a7
(0.8.0.dev), verl/experimental/agent_loop/agent_loop.py, in declaration order."""

VERL_AGENT_LOOP_METRICS_FIELDS = ("generate_sequences", "tool_calls", "num_preempted")
"""`AgentLoopMetrics` in the same file; its defaults are 0.0, 0.0, -1 ("not available")."""

# --- SkyRL --------------------------------------------------------------------------
SKYRL_GENERATOR_OUTPUT_FIELDS = (
    "prompt_token_ids",
    "response_ids",
    "rewards",
    "loss_masks",
    "stop_reasons",
    "rollout_metrics",
    "rollout_logprobs",
    "trajectory_ids",
    "trajectory_generation_times",
    "trajectory_time_splits",
    "rollout_expert_indices",
    "is_last_step",
    "env_metrics",
    "pixel_values",
    "image_grid_thw",
)
"""`GeneratorOutput` (TypedDict), NovaSky-AI/SkyRL@a9564572eb8e91076be43c1bd5e4615e3de17265,
skyrl/train/generators/base.py (formerly skyrl-train/skyrl_train/generators/base.py),
in declaration order."""

SKYRL_STOP_REASONS = {"completed": "stop", "truncated": "length", "aborted": "abort"}
"""Our status -> the engine finish reason SkyRL expects in `stop_reasons`
(`apply_overlong_filtering` in skyrl/train/generators/utils.py keeps the mask only
for "stop"; "abort" is the finish reason of an aborted request in
skyrl/backends/skyrl_train/inference_servers/remote_inference_client.py)."""

# --- miles --------------------------------------------------------------------------
MILES_SAMPLE_WIRE_FIELDS = (
    "tokens",
    "response",
    "response_length",
    "loss_mask",
    "rollout_log_probs",
    "rollout_routed_experts",
    "rollout_indexer_topk",
    "status",
    "weight_versions",
    "prefix_cache_info",
    "metadata",
    "reward",
)
"""`SAMPLES_VALUE_SPEC_V2` (the tree-serving v2 samples wire: v1's table plus
`reward`), radixark/miles@31f1ca961a94cb860cec3b2dea34ec332bfa8f76,
miles/rollout/session/samples/codec.py, in table order."""

MILES_WIRE_DTYPES: dict[str, np.dtype] = {
    "tokens": np.dtype(np.int64),
    "loss_mask": np.dtype(np.uint8),
    "rollout_log_probs": np.dtype(np.float64),
    "rollout_routed_experts": np.dtype(np.int32),
    "rollout_indexer_topk": np.dtype(np.int32),
}
"""The tensor fields' pinned dtypes in that table (a mismatch raises there, it is never
converted); every other field is JSON."""

# --- slime --------------------------------------------------------------------------
SLIME_SAMPLE_FIELDS = (
    "tokens",
    "response",
    "response_length",
    "reward",
    "loss_mask",
    "weight_versions",
    "rollout_log_probs",
    "status",
    "metadata",
)
"""The `Sample` dataclass fields we fill, THUDM/slime@624b824a898ab0ec1fcb4d373004c7f3852bf515,
slime/utils/types.py (declaration order). Every other field keeps its default."""


def _verl_num_turns(turns: Sequence[tuple[int, int, int]]) -> int:
    """verl counts the first prompt, each assistant turn and each user/tool turn
    (`user_turns + assistant_turns + 1` in tool_agent_loop.py; 2 for one turn). A
    user/tool turn is the tokens inserted between two assistant turns."""
    inserted = sum(1 for prev, cur in zip(turns, turns[1:], strict=False) if cur[1] > prev[2])
    return 1 + len(turns) + inserted if turns else 0


# --- the mappings -------------------------------------------------------------------
def to_verl(sample: Any) -> dict[str, Any]:
    """One sample as the keyword arguments of verl's `AgentLoopOutput`.

    Source: volcengine/verl@b178a3cd56f58b2d502255daba591e92833930a7 (0.8.0.dev),
    verl/experimental/agent_loop/agent_loop.py: `AgentLoopOutput` fields
    `prompt_ids: list[int]`, `response_ids: list[int]` ("including LLM generated
    token, tool response token"), `response_mask: list[int]` ("1 for LLM generated
    token, 0 for tool response token"), `response_logprobs: Optional[list[float]]`
    (per response token), `routed_experts: Optional[Any]`, `multi_modal_data:
    Optional[dict]`, `reward_score: Optional[float]`, `num_turns: int`, `metrics:
    AgentLoopMetrics` (required), `extra_fields: dict[str, Any]`. Conventions from
    tool_agent_loop.py in the same commit: tool tokens get mask 0 and logprob 0.0,
    `prompt_ids` is the initial prompt, `num_turns = user_turns + assistant_turns + 1`.

    Lists, as declared (`list[int]`), not arrays: verl pads them with list
    concatenation (`output.response_logprobs + [0.0] * pad_size`). The response
    keeps every token to the end. `metrics` carries verl's defaults (we measure
    none of them); `extra_fields` (copied into verl's non-tensor batch) carries
    `status`, `tree_path`, `weight_versions` (one per turn), `metadata`,
    `turn_scores` (one per turn: its per-turn reward, None where none) and
    `turn_lineage` (one per turn: which agent asked for it, None where unknown).
    """
    v = sample_view(sample)
    s, e = v.response_start, v.response_end(keep_tail=True)
    return {
        "prompt_ids": v.token_ids[:s].tolist(),
        "response_ids": v.token_ids[s:e].tolist(),
        "response_mask": v.loss_mask[s:e].tolist(),
        "response_logprobs": v.logprobs[s:e].tolist(),
        # positions [0, len(prompt_ids + response_ids) - 1) in the sample's dtype
        "routed_experts": v.routed_experts,
        "multi_modal_data": None,
        "reward_score": v.reward,
        "num_turns": _verl_num_turns(v.turns),
        "metrics": {"generate_sequences": 0.0, "tool_calls": 0.0, "num_preempted": -1},
        "extra_fields": {
            "status": v.status,
            "tree_path": v.path,
            "weight_versions": v.weight_versions(),
            "metadata": v.metadata,
            # verl's name: tool_agent_loop.py puts `extra_fields["turn_scores"]` (per turn) here
            "turn_scores": list(v.turn_rewards),
            "turn_lineage": list(v.turn_lineage),
            **turn_sampling_field(v),
        },
    }


def to_skyrl(samples: Sequence[Any], *, default_reward: float | None = None) -> dict[str, Any]:
    """A batch of samples as SkyRL's `GeneratorOutput` (one row per sample).

    Source: NovaSky-AI/SkyRL@a9564572eb8e91076be43c1bd5e4615e3de17265,
    skyrl/train/generators/base.py: `GeneratorOutput(TypedDict)` with
    `prompt_token_ids: List[List[int]]`, `response_ids: List[List[int]]`,
    `rewards: Union[List[float], List[List[float]]]`, `loss_masks: List[List[int]]`,
    `stop_reasons: Optional[List[str]]`, `rollout_metrics: Optional[Dict]`,
    `rollout_logprobs: Optional[List[List[float]]]`, `trajectory_ids:
    Optional[List[TrajectoryID]]`, `trajectory_generation_times`,
    `trajectory_time_splits`, `rollout_expert_indices`, `is_last_step`,
    `env_metrics`, `pixel_values`, `image_grid_thw` (all Optional). Conventions:
    skyrl/train/generators/skyrl_gym_generator.py `TurnOutput.get_turn_loss_mask`
    / `get_turn_rollout_logprobs` (observation tokens mask 0, logprob 0.0; both per
    response token) and the response cut right after the last generated token;
    skyrl/train/utils/trainer_utils.py `validate_generator_output` (every row of
    `response_ids`, `loss_masks`, `rollout_logprobs` the same length; all batch
    lists as long as `response_ids`).

    Lists, not arrays: SkyRL concatenates these with `+`. `rewards` is one
    trajectory-level float per row; a sample without a reward takes
    `default_reward`, and without one this raises `ExportError` (SkyRL has no
    "no reward"). When any sample of the batch has per-turn rewards, every row of
    `rewards` is SkyRL's token-level form instead (one float per response token, as
    `_build_per_token_rewards` in skyrl_gym_generator.py builds it): each turn's
    reward on its last sampled token, 0.0 elsewhere (SkyRL's fill; the sample's `turn_rewards`
    tell "none" from 0), and the trajectory-level reward (or `default_reward`) added
    on the last response token, where SkyRL's final step puts it; a row then needs a
    turn reward or a trajectory-level one. Fields we cannot know are None. SkyRL has no
    per-row field for the turns' lineage: select by agent when reading the samples
    (the server's ``agent`` / ``agent_kind``) instead.
    """
    views = [sample_view(s) for s in samples]
    if not views:
        raise ExportError("GeneratorOutput needs at least one sample")
    cuts = [(v, v.response_start, v.response_end(keep_tail=False)) for v in views]
    per_token = any(v.rewarded() for v in views)
    rewards: list[Any] = []
    for i, (v, s, e) in enumerate(cuts):
        reward = v.reward if v.reward is not None else default_reward
        if reward is None and not v.rewarded():
            raise ExportError(f"sample {i} has no reward and no default_reward was given")
        if not per_token:
            rewards.append(float(reward))  # type: ignore[arg-type]  # checked just above
            continue
        row = v.response_token_rewards(s, e)
        if reward is not None and row:  # the episode's reward is the last step's (SkyRL's env)
            row[-1] += float(reward)
        rewards.append(row)
    out: dict[str, Any] = dict.fromkeys(SKYRL_GENERATOR_OUTPUT_FIELDS)
    out.update(
        prompt_token_ids=[v.token_ids[:s].tolist() for v, s, _ in cuts],
        response_ids=[v.token_ids[s:e].tolist() for v, s, e in cuts],
        rewards=rewards,
        loss_masks=[v.loss_mask[s:e].tolist() for v, s, e in cuts],
        stop_reasons=[SKYRL_STOP_REASONS[v.status] for v in views],
        rollout_logprobs=[v.logprobs[s:e].tolist() for v, s, e in cuts],
    )
    return out


def to_miles(sample: Any) -> dict[str, Any]:
    """One sample as the values miles' samples wire carries (`SAMPLES_VALUE_SPEC_V2`).

    Source: radixark/miles@31f1ca961a94cb860cec3b2dea34ec332bfa8f76,
    miles/rollout/session/samples/codec.py: `tokens` int64, `response` json,
    `response_length` json, `loss_mask` uint8, `rollout_log_probs` float64,
    `rollout_routed_experts` int32 (strict), `rollout_indexer_topk` int32 (strict),
    `status` json (the `Sample.Status` value), `weight_versions` json,
    `prefix_cache_info` json (`PrefixCacheInfo.to_dict()`), `metadata` json, and
    v2's `reward` json. Conventions from miles/utils/types.py (`Sample.validate`:
    `tokens` is prompt + response, `loss_mask` and `rollout_log_probs` have
    `response_length` entries) and miles/rollout/generate_utils/sample_utils.py
    (`_merge_sample_pair`: observation tokens between turns get mask 0 and logprob
    0.0; `weight_versions` gets one entry per turn; the merged `tokens` end with the
    last turn's output).

    Tensor fields are numpy arrays in exactly the pinned dtypes; the rest are JSON
    values. `response` (the decoded text) is "" since we hold no tokenizer,
    `rollout_routed_experts` is the sample's routed experts cut to the tokens
    (``len(tokens) - 1`` rows, int32, as miles' `Sample.validate` checks; None when
    the session did not record them), `rollout_indexer_topk` is None,
    `prefix_cache_info` is zeros, and the tree path and the per-turn rewards (miles has no
    per-turn field) are added to `metadata` as `tree_path` and `turn_rewards`, and each
    turn's lineage (which agent asked for it) as `turn_lineage`. With sampling
    support: `rollout_sampling_mask_ids` / `_offsets` (`trajectory.support.miles_sampling_mask`).
    """
    v = sample_view(sample)
    s, e = v.response_start, v.response_end(keep_tail=False)
    names = ("rollout_sampling_mask_ids", "rollout_sampling_mask_offsets")
    sup = v.sampling_support
    support = {} if sup is None else dict(zip(names, miles_sampling_mask(sup, v.token_ids, s, e), strict=True))
    return {
        "tokens": v.token_ids[:e].astype(MILES_WIRE_DTYPES["tokens"]),
        "response": "",
        "response_length": e - s,
        "loss_mask": v.loss_mask[s:e].astype(MILES_WIRE_DTYPES["loss_mask"]),
        "rollout_log_probs": v.logprobs[s:e].astype(MILES_WIRE_DTYPES["rollout_log_probs"]),
        # miles: shape (len(tokens) - 1, layers, topk), int32 (Sample.validate)
        "rollout_routed_experts": None if v.routed_experts is None
        else v.routed_experts[: max(0, e - 1)].astype(MILES_WIRE_DTYPES["rollout_routed_experts"]),
        "rollout_indexer_topk": None,
        "status": v.status,
        "weight_versions": v.weight_versions(),
        "prefix_cache_info": {"cached_tokens": 0, "total_prompt_tokens": 0},
        "metadata": {**v.metadata, "tree_path": v.path, "turn_rewards": list(v.turn_rewards),
                     "turn_lineage": list(v.turn_lineage),
                     **turn_sampling_field(v)},
        "reward": v.reward,
        **support,
    }


def to_slime(sample: Any) -> dict[str, Any]:
    """One sample as keyword arguments of slime's `Sample` dataclass.

    Source: THUDM/slime@624b824a898ab0ec1fcb4d373004c7f3852bf515, slime/utils/types.py:
    `tokens: list[int]`, `response: str`, `response_length: int`, `reward: float |
    dict | None`, `loss_mask: list[int] | None`, `weight_versions: list[str]`,
    `rollout_log_probs: list[float] | None`, `status: Sample.Status` (values
    "pending", "completed", "truncated", "aborted", "failed"), `metadata: dict`.
    Conventions from `Sample.append_response_tokens` and
    `_validate_response_metadata_lengths` there: `tokens` is prompt + response,
    non-trainable (tool) tokens get mask 0 and logprob 0.0, `loss_mask` and
    `rollout_log_probs` have `response_length` entries; `_apply_meta_info` appends
    one `weight_versions` entry per generation call.

    slime has no wire codec (unlike miles) and no dtype pins: its fields are Python
    lists, which its code extends with `+`, so that is what we give. `status` is the
    enum's value string (build the enum with `Sample.Status(d["status"])`);
    `response` is "" (no tokenizer here); the tree path and the per-turn rewards
    (slime's `reward` is the trajectory's) go to `metadata` as `tree_path`,
    `turn_rewards` and `turn_lineage` (each turn's agent). The response ends with the last turn's output, as in miles.
    """
    v = sample_view(sample)
    s, e = v.response_start, v.response_end(keep_tail=False)
    return {
        "tokens": v.token_ids[:e].tolist(),
        "response": "",
        "response_length": e - s,
        "reward": v.reward,
        "loss_mask": v.loss_mask[s:e].tolist(),
        "weight_versions": v.weight_versions(),
        "rollout_log_probs": v.logprobs[s:e].tolist(),
        "status": v.status,
        "metadata": {**v.metadata, "tree_path": v.path, "turn_rewards": list(v.turn_rewards),
                     "turn_lineage": list(v.turn_lineage),
                     **turn_sampling_field(v)},
    }
