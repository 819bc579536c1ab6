"""Field mappings from our training sample to the sample formats RL frameworks consume.

Plain dicts, lists and numpy arrays only: no framework is imported, so an RL worker
can build the framework's own object from the dict (``AgentLoopOutput(**d)``,
``Sample(**d)``) without this library depending on verl, SkyRL, slime or miles.

Our sample (``trajectory.samples``) is read through a small accessor, so any object
with these attributes, or any mapping with these keys, works:

    token_ids        int32 [T]      the whole sequence
    loss_mask        uint8 [T]      1 on tokens this sample trains (exactly-once: a
                                    sampled token shared with an earlier sample is 0)
    logprobs         float32 [T]    0.0 where the mask is 0
    weight_version   [T]            per-token weight version (None off sampled tokens)
    turn_boundaries  [(prompt_start, output_start, output_end)] per turn
    status           'completed' | 'truncated' | 'aborted'
    reward           float | None
    metadata         dict
    path             list[int]      the leaf's path in the branch tree

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

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from trajectory.errors import ExportError
from trajectory.support import miles_sampling_mask

STATUSES = ("completed", "truncated", "aborted")

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


# --- reading our sample -------------------------------------------------------------
def _field(sample: Any, name: str) -> Any:
    """One field of a sample that is a mapping (key) or an object (attribute)."""
    if isinstance(sample, Mapping):
        if name not in sample:
            raise ExportError(f"sample has no field {name!r}")
        return sample[name]
    try:
        return getattr(sample, name)
    except AttributeError:
        raise ExportError(f"sample has no field {name!r}") from None


@dataclass(frozen=True, slots=True)
class _View:
    """Our sample, checked and split into prompt and response."""

    token_ids: np.ndarray  # int32 [T]
    loss_mask: np.ndarray  # uint8 [T]
    logprobs: np.ndarray  # float32 [T]
    weight_version: Sequence[Any]  # [T]
    turns: tuple[tuple[int, int, int], ...]
    status: str
    reward: float | None
    metadata: dict[str, Any]
    path: list[int]
    response_start: int  # first turn's output_start (T when there are no turns)
    last_output_end: int  # last turn's output_end (T when there are no turns)
    routed_experts: np.ndarray | None = None  # (T - 1, layers, topk): positions [0, T - 1)

    def response_end(self, keep_tail: bool) -> int:
        """End of the response: the whole sequence, or just after the last sampled token."""
        return len(self.token_ids) if keep_tail else self.last_output_end

    def weight_versions(self) -> list[str]:
        """One entry per generation call, as slime and miles record them: the version
        of each turn's last sampled token (the one that finished the turn, which is
        what SGLang reports in `meta_info.weight_version`), as a string. Turns with no
        sampled token or no known version add nothing, as a reply without
        `weight_version` adds nothing there."""
        out: list[str] = []
        for _, start, end in self.turns:
            if end > start and (v := self.weight_version[end - 1]) is not None:
                out.append(str(v))
        return out


def _array(sample: Any, name: str, dtype: type) -> np.ndarray:
    """A one-dimensional field in `dtype`; integer fields must convert without change
    (a float id or a negative mask is refused, not rounded or wrapped)."""
    arr = np.asarray(_field(sample, name))
    if arr.ndim != 1:
        raise ExportError(f"sample {name} must be one-dimensional, got shape {arr.shape}")
    out: np.ndarray = arr.astype(dtype, copy=False)
    if np.dtype(dtype).kind in "iu" and arr.size and not np.array_equal(out, arr):
        raise ExportError(f"sample {name} does not fit {np.dtype(dtype)} exactly")
    return out


def _check_mask_inside_outputs(loss_mask: np.ndarray, turns: Sequence[tuple[int, int, int]]) -> None:
    """Mask 1 only on sampled positions: a trainable token outside every turn's output
    would land in the prompt (untrained) or be cut with the tail."""
    sampled = np.zeros(len(loss_mask), dtype=bool)
    for _, start, end in turns:
        sampled[start:end] = True
    stray = (loss_mask > 1) | ((loss_mask != 0) & ~sampled)
    if stray.any():
        i = int(np.argmax(stray))
        raise ExportError(f"sample loss_mask[{i}] = {int(loss_mask[i])} outside the turns' sampled tokens")


def _turns(raw: Any, n: int) -> tuple[tuple[int, int, int], ...]:
    """Turn boundaries as int triples, each in order and after the previous turn."""
    try:
        turns = tuple((int(a), int(b), int(c)) for a, b, c in raw)
    except (TypeError, ValueError) as err:
        raise ExportError(f"turn_boundaries must be (prompt_start, output_start, output_end) triples: {err}") from None
    prev_end = 0
    for i, (p, s, e) in enumerate(turns):
        if not prev_end <= p <= s <= e <= n:
            raise ExportError(f"turn {i} boundaries {(p, s, e)} out of order (previous end {prev_end}, length {n})")
        prev_end = e
    return turns


def _view(sample: Any) -> _View:
    """Read and check one sample: equal lengths, ordered turns, a known status."""
    token_ids = _array(sample, "token_ids", np.int32)
    n = len(token_ids)
    loss_mask = _array(sample, "loss_mask", np.uint8)
    logprobs = _array(sample, "logprobs", np.float32)
    weight_version = _field(sample, "weight_version")
    for name, arr in (("loss_mask", loss_mask), ("logprobs", logprobs), ("weight_version", weight_version)):
        if len(arr) != n:
            raise ExportError(f"sample {name} has {len(arr)} entries for {n} tokens")
    turns = _turns(_field(sample, "turn_boundaries"), n)
    _check_mask_inside_outputs(loss_mask, turns)
    status = _field(sample, "status")
    if status not in STATUSES:
        raise ExportError(f"sample status {status!r} is not one of {STATUSES}")
    reward = _field(sample, "reward")
    return _View(
        token_ids=token_ids,
        loss_mask=loss_mask,
        logprobs=logprobs,
        weight_version=weight_version,
        turns=turns,
        status=status,
        reward=None if reward is None else float(reward),
        metadata=dict(_field(sample, "metadata") or {}),
        path=[int(i) for i in _field(sample, "path")],
        response_start=turns[0][1] if turns else n,
        last_output_end=turns[-1][2] if turns else n,
        routed_experts=_sample_routed(sample, n),
    )


def _sample_routed(sample: Any, n: int) -> np.ndarray | None:
    """The sample's routed experts (optional field): one row per position but the last."""
    raw = sample.get("routed_experts") if isinstance(sample, Mapping) else getattr(sample, "routed_experts", None)
    if raw is None:
        return None
    arr = np.asarray(raw)
    if arr.ndim != 3 or arr.shape[0] != max(0, n - 1) or arr.dtype.kind not in "iu":
        raise ExportError(f"sample routed_experts must be integers [{max(0, n - 1)}, layers, topk], got {arr.shape}")
    return arr


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
    `status`, `tree_path`, `weight_versions` (one per turn) and `metadata`.
    """
    v = _view(sample)
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
    "no reward"). Fields we cannot know (trajectory ids, timings, metrics) are None.
    """
    views = [_view(s) for s in samples]
    if not views:
        raise ExportError("GeneratorOutput needs at least one sample")
    rewards = []
    for i, v in enumerate(views):
        reward = v.reward if v.reward is not None else default_reward
        if reward is None:
            raise ExportError(f"sample {i} has no reward and no default_reward was given")
        rewards.append(float(reward))
    cuts = [(v, v.response_start, v.response_end(keep_tail=False)) for v in views]
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
    `prefix_cache_info` is zeros, and the tree path is added to `metadata` as `tree_path`. With sampling
    support: `rollout_sampling_mask_ids` / `_offsets` (`trajectory.support.miles_sampling_mask`).
    """
    v = _view(sample)
    s, e = v.response_start, v.response_end(keep_tail=False)
    names = ("rollout_sampling_mask_ids", "rollout_sampling_mask_offsets")
    sup = sample.get("sampling_support") if isinstance(sample, Mapping) else getattr(sample, "sampling_support", None)
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
        "metadata": {**v.metadata, "tree_path": v.path},
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
    `response` is "" (no tokenizer here); the tree path goes to `metadata` as
    `tree_path`. The response ends with the last turn's output, as in miles.
    """
    v = _view(sample)
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
        "metadata": {**v.metadata, "tree_path": v.path},
    }
