"""Our training sample read and checked for the framework mappings (`trajectory.frameworks`).

Any object with the sample's attributes, or any mapping with its keys, is read (the
fields are listed in `trajectory.frameworks`' module doc); what the mappings share
(the prompt/response split, the weight versions per generation call, the per-turn
rewards and lineage) is computed here once, so the mapping module holds only the mappings.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from trajectory.errors import ExportError, TrajectoryError
from trajectory.lineage import lineage_from_dict
from trajectory.support import SupportCSR
from trajectory.turn_rewards import token_rewards

STATUSES = ("completed", "truncated", "aborted")


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
class SampleView:
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
    turn_rewards: tuple[float | None, ...] = ()  # one per turn, None where none
    turn_lineage: tuple[dict[str, Any] | None, ...] = ()  # one per turn: who asked (`trajectory.lineage`)
    turn_sampling: list[Any] | None = None  # per turn: its recorded `sampling` (None: not recorded)
    sampling_support: SupportCSR | None = None  # one row per token, when the session captured it

    def rewarded(self) -> bool:
        """Whether any turn has a reward of its own."""
        return any(r is not None for r in self.turn_rewards)

    def response_token_rewards(self, start: int, end: int) -> list[float]:
        """Per-token rewards of the response `[start, end)`: each turn's reward on its last
        sampled token, 0.0 elsewhere (`trajectory.turn_rewards.token_rewards`)."""
        values, _ = token_rewards(self.turns, self.turn_rewards, len(self.token_ids))
        out: list[float] = values[start:end].tolist()
        return out

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


def sample_view(sample: Any) -> SampleView:
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
    return SampleView(
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
        turn_rewards=_sample_turn_rewards(sample, len(turns)),
        turn_lineage=_sample_turn_lineage(sample, len(turns)),
        turn_sampling=_turn_sampling(sample, len(turns)),
        sampling_support=_sample_support(sample, n),
    )


def _sample_support(sample: Any, n: int) -> SupportCSR | None:
    """The sample's sampling support (optional field): a `SupportCSR` with one row per
    token, or a mapping of its `ids` and `offsets`."""
    raw = sample.get("sampling_support") if isinstance(sample, Mapping) else getattr(sample, "sampling_support", None)
    if raw is None:
        return None
    try:
        sup = raw if isinstance(raw, SupportCSR) else SupportCSR(np.asarray(raw["ids"], dtype=np.int32),
                                                                  np.asarray(raw["offsets"], dtype=np.int32))
    except (TypeError, KeyError, ValueError, TrajectoryError) as exc:
        raise ExportError(f"sample sampling_support is not CSR ids and offsets ({exc})") from None
    if len(sup) != n:
        raise ExportError(f"sample sampling_support has {len(sup)} rows for {n} tokens")
    return sup


def turn_sampling_field(v: SampleView) -> dict[str, Any]:
    """`{"turn_sampling": [...]}` when some turn recorded its sampling, else nothing (a
    sample from a server that records none maps as it always did)."""
    return {"turn_sampling": v.turn_sampling} if any(t is not None for t in v.turn_sampling or ()) else {}


def _turn_sampling(sample: Any, n_turns: int) -> list[Any]:
    """Each turn's recorded `sampling` from the sample's per-turn diagnostics (a sample
    without diagnostics, e.g. a hand-built mapping, gives None per turn)."""
    diags = sample.get("diagnostics") if isinstance(sample, Mapping) else getattr(sample, "diagnostics", None)
    if not diags:
        return [None] * n_turns
    if len(diags) != n_turns:
        raise ExportError(f"sample has {len(diags)} diagnostics for {n_turns} turns")
    return [d.get("sampling") if isinstance(d, Mapping) else None for d in diags]


def _sample_turn_lineage(sample: Any, n_turns: int) -> tuple[dict[str, Any] | None, ...]:
    """The sample's per-turn lineage (optional field; absent or empty: unknown), one per
    turn, each checked as a lineage and copied (a mapping's dict is not shared)."""
    raw = sample.get("turn_lineage") if isinstance(sample, Mapping) else getattr(sample, "turn_lineage", None)
    if not raw:
        return (None,) * n_turns
    if len(raw) != n_turns:
        raise ExportError(f"sample turn_lineage has {len(raw)} entries for {n_turns} turns")
    try:
        return tuple(None if (lin := lineage_from_dict(d)) is None else lin.to_dict() for d in raw)
    except ValueError as exc:
        raise ExportError(f"sample turn_lineage: {exc}") from None


def _sample_turn_rewards(sample: Any, n_turns: int) -> tuple[float | None, ...]:
    """The sample's per-turn rewards (optional field; absent or empty: none), one per turn."""
    raw = sample.get("turn_rewards") if isinstance(sample, Mapping) else getattr(sample, "turn_rewards", None)
    if not raw:
        return (None,) * n_turns
    if len(raw) != n_turns:
        raise ExportError(f"sample turn_rewards has {len(raw)} entries for {n_turns} turns")
    return tuple(None if r is None else float(r) for r in raw)


def _sample_routed(sample: Any, n: int) -> np.ndarray | None:
    """The sample's routed experts (optional field): one row per position but the last."""
    raw = sample.get("routed_experts") if isinstance(sample, Mapping) else getattr(sample, "routed_experts", None)
    if raw is None:
        return None
    arr = np.asarray(raw)
    if arr.ndim != 3 or arr.shape[0] != max(0, n - 1) or arr.dtype.kind not in "iu":
        raise ExportError(f"sample routed_experts must be integers [{max(0, n - 1)}, layers, topk], got {arr.shape}")
    return arr
