"""Training samples from a session's branch tree: each sampled token trained once.

A session is a tree of branches (`trajectory.tree`); the trainer wants a flat
list of sequences. `build_samples` turns the tree (or its `export.to_dict`
form) into one `Sample` per *kept leaf*:

**Lines and leaves.** A branch's trajectory is a whole line: its parent's turns
up to the fork checkpoint, then its own. A branch holds a *leaf* when it has at
least one turn and no child forks from it at its last checkpoint (such a child
contains the whole line). Turn ``i`` of a line is *owned* by the branch that
committed it: the branch itself when ``i >= fork_checkpoint``, else the owner of
turn ``i`` on its parent. Two lines share exactly the turns with the same owner,
and those form a common prefix (same tokens at the same positions).

**Pickers** (`PICKERS`, by name; `register_picker` adds one) choose which leaves
become samples:

* ``all`` keeps every leaf.
* ``latest`` (default) drops abandoned retries. Turn ``i`` of a line is the tree
  node ``(owner, i)``; its parent node is the line's turn ``i - 1`` (the root
  for ``i = 0``). Continuations of the same node are alternatives: a retry
  (the agent re-sent an earlier prefix) adds one, and the agent may also go back
  to an older one. Among them the one whose subtree holds the *latest* commit
  (the highest `TurnRecord.seq`, the tree's commit order) is kept, and every
  leaf below the others is dropped. At the root only continuations whose first
  turn answered the same request messages compete: a different first request
  is another conversation (a sub-agent, a rewritten or compacted history), and
  what the model saw and produced there is valid training data.

**Exactly-once masking.** Kept leaves are visited in creation order (branch
id); a turn is trained (its sampled tokens keep mask 1) in the first kept
sample that contains it, and has mask 0 and logprob 0.0 in every later one.
The turns an earlier sample trains always form a prefix of a later line, so
this is one slice per sample.

**Truncation.** ``max_seq_len=N`` keeps the longest run of whole turns that ends
at or before N (a turn ends after its closing repair tokens); it never cuts
inside a turn. Shared turns sit at the same positions in every line, so they
are kept or dropped alike everywhere and exactly-once still holds over what is
kept. A sample whose first turn already ends past N is returned empty
(zero-length arrays, no turns) with ``status="truncated"`` and a `reason`.

**Status** comes from the last kept turn's finish reason: ``stop`` and
``tool_calls`` -> ``completed``; ``length`` -> ``truncated``; anything else
(``abort``, ``error``, an unknown reason) -> ``aborted``. Dropping turns for
``max_seq_len`` makes it ``truncated`` (with a `reason`).

**Weight versions** are per token as an index: ``weight_version_index[i]`` is
the position in ``version_table`` of the version that sampled token ``i``, or
-1 where no version applies (prompt, tool, template and repair tokens, and
sampled tokens whose version is unknown, i.e. None). ``Sample.weight_version``
expands this to one value (or None) per token.

**Per-turn rewards** (`turn_rewards`, one per turn, None where none) name turns by
their seq (`trajectory.turn_rewards`); every sample whose line holds a turn carries it.
**Lineage** (`turn_lineage`, one per turn: `Lineage.to_dict()`, None where the client
said nothing) says which agent asked for each turn. ``agent=AgentFilter(...)`` keeps the
lines holding a turn of that agent (or kind): only those turns are trained (the other
agents' turns in the line stay as context, mask 0 and logprob 0.0), the line is cut
after its last such turn (``reason`` says so), and a cut line whose turns an earlier
sample already trains is dropped.

Cost: O(tokens of the sample) numpy copies per sample plus O(turns) Python per
sample; no per-token Python loops. Serialization lives in
`trajectory.sample_formats`.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import orjson

from trajectory.errors import SampleError
from trajectory.export import from_dict
from trajectory.lineage import AgentFilter
from trajectory.messages import normalize_message
from trajectory.routed import line_rows
from trajectory.sample_turns import turn_diagnostics, weight_versions
from trajectory.support import SupportCSR, line_support
from trajectory.tree import Branch, TrajectoryTree
from trajectory.turn_record import TurnRecord, WeightVersion
from trajectory.turn_rewards import check_turn_rewards, committed_seqs

STATUSES = ("completed", "truncated", "aborted")
COMPLETED_FINISH_REASONS = frozenset({"stop", "tool_calls"})
TRUNCATED_FINISH_REASONS = frozenset({"length"})
DEFAULT_PICKER = "latest"


@dataclass(eq=False, slots=True)
class Sample:
    """One training sequence: a kept leaf's line, masked exactly once.

    Arrays have one entry per token. `turn_boundaries` holds one
    ``(prompt_start, output_start, output_end)`` per turn: the prompt is
    ``[prompt_start, output_start)``, the sampled output
    ``[output_start, output_end)``; a turn's closing repair tokens (mask 0) run
    to the next turn's ``prompt_start`` (the last turn's to the end).
    `diagnostics` has one dict per turn (`trajectory.sample_turns.turn_diagnostics`); `path` is the
    branch ids from the root to the leaf; `reason` says why a sample was cut
    (None when it was not). `routed_experts` (routing replay) has one row per
    position but the last: shape ``(len - 1, layers, topk)``, uint8/int16.
    """

    token_ids: np.ndarray  # int32
    loss_mask: np.ndarray  # uint8
    logprobs: np.ndarray  # float32, 0.0 where loss_mask is 0
    weight_version_index: np.ndarray  # int32, -1 = no version
    version_table: list[WeightVersion]
    turn_boundaries: list[tuple[int, int, int]]
    status: str
    reason: str | None = None
    reward: float | None = None
    # one per turn: its posted reward, None where none (`trajectory.turn_rewards`)
    turn_rewards: list[float | None] = field(default_factory=list)
    # one per turn: who asked for it (`trajectory.lineage.Lineage.to_dict()`), None where unknown
    turn_lineage: list[dict[str, Any] | None] = field(default_factory=list)
    metadata: dict[str, Any] = field(default_factory=dict)
    diagnostics: list[dict[str, Any]] = field(default_factory=list)
    path: list[int] = field(default_factory=list)
    # routing replay: (len - 1, layers, topk) expert ids of positions [0, len - 1)
    # (`trajectory.routed.line_rows`); None when the session did not record them
    routed_experts: np.ndarray | None = None
    # sampling support (`trajectory.support`): CSR over every token, a sampled token's row
    # the ids its sampler could draw, the others empty; None when the session did not ask
    sampling_support: SupportCSR | None = None

    def __post_init__(self) -> None:
        if not self.turn_rewards:  # not given: no turn has a reward
            self.turn_rewards = [None] * len(self.turn_boundaries)
        if not self.turn_lineage:  # not given: no turn is labelled
            self.turn_lineage = [None] * len(self.turn_boundaries)

    def __len__(self) -> int:
        return int(self.token_ids.shape[0])

    @property
    def leaf(self) -> int | None:
        """Branch id of the leaf this sample came from."""
        return self.path[-1] if self.path else None

    @property
    def weight_version(self) -> np.ndarray:
        """Per-token weight version (object array; None where the index is -1)."""
        lookup = np.empty(len(self.version_table) + 1, dtype=object)
        lookup[: len(self.version_table)] = self.version_table
        lookup[-1] = None
        out: np.ndarray = lookup[self.weight_version_index]
        return out

    @property
    def num_trainable(self) -> int:
        return int(np.count_nonzero(self.loss_mask))


# -- the tree as lines ---------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TreeLines:
    """What pickers need: the tree, each branch's turn owners, and the leaves."""

    tree: TrajectoryTree
    owners: dict[int, list[int]]  # branch id -> owner branch id of each of its turns
    leaves: list[int]  # branch ids holding a leaf, in creation order

    def node(self, branch_id: int, checkpoint: int) -> tuple[int, int] | None:
        """The tree node after `checkpoint` of a branch's line (None: the root)."""
        if checkpoint == 0:
            return None
        return (self.owners[branch_id][checkpoint - 1], checkpoint - 1)

    def path(self, branch_id: int) -> list[int]:
        """Branch ids from the root to `branch_id`."""
        out = []
        b: int | None = branch_id
        while b is not None:
            out.append(b)
            b = self.tree.get(b).parent_id
        return out[::-1]


def tree_lines(tree: TrajectoryTree) -> TreeLines:
    """Owners of every branch's turns and the leaves; O(turns over all branches)."""
    ordered = sorted(tree.branches(), key=lambda b: b.id)  # parents precede children
    owners: dict[int, list[int]] = {}
    contained: set[int] = set()  # branches a child continues from their last checkpoint
    for b in ordered:
        n = b.trajectory.num_turns
        inherited = [] if b.parent_id is None else owners[b.parent_id][: b.fork_checkpoint]
        owners[b.id] = inherited + [b.id] * (n - b.fork_checkpoint)
        if b.parent_id is not None and b.fork_checkpoint == tree.get(b.parent_id).trajectory.num_turns:
            contained.add(b.parent_id)
    leaves = [b.id for b in ordered if b.trajectory.num_turns and b.id not in contained]
    return TreeLines(tree, owners, leaves)


# -- pickers -------------------------------------------------------------------

Picker = Callable[[TreeLines], Sequence[int]]


def pick_all(lines: TreeLines) -> list[int]:
    """Every leaf."""
    return list(lines.leaves)


def pick_latest(lines: TreeLines) -> list[int]:
    """Every leaf not below an abandoned alternative (module doc: Pickers).

    O(turns over the leaves' lines)."""
    turn_of: dict[tuple[int, int], TurnRecord] = {}
    latest: dict[tuple[int, int], int] = {}  # node -> highest seq in its subtree
    for leaf in lines.leaves:
        turns = lines.tree.get(leaf).trajectory.turns
        last = turns[-1].seq
        for i, owner in enumerate(lines.owners[leaf]):
            node = (owner, i)
            turn_of[node] = turns[i]
            latest[node] = max(latest.get(node, -1), last)
    best: dict[Any, int] = {}  # a group of alternatives -> the latest subtree among them
    group_of: dict[tuple[int, int], Any] = {}
    for owner, i in latest:
        if i == 0:  # at the root, alternatives answered the same first request
            group: Any = ("root", _request_key(turn_of[(owner, 0)]))
        else:
            group = None  # filled per line below: the parent node
        group_of[(owner, i)] = group
    for leaf in lines.leaves:
        owners = lines.owners[leaf]
        for i in range(1, len(owners)):
            group_of[(owners[i], i)] = (owners[i - 1], i - 1)
    for node, seq in latest.items():
        g = group_of[node]
        best[g] = max(best.get(g, -1), seq)
    kept = []
    for leaf in lines.leaves:
        owners = lines.owners[leaf]
        if all(latest[(o, i)] == best[group_of[(o, i)]] for i, o in enumerate(owners)):
            kept.append(leaf)
    return kept


def _request_key(turn: TurnRecord) -> bytes:
    """The first turn's request messages in normal form (what makes two first turns
    alternatives of each other)."""
    return b"\x00".join(orjson.dumps(normalize_message(m), option=orjson.OPT_SORT_KEYS,
                                     default=str) for m in turn.request_messages)


PICKERS: dict[str, Picker] = {"latest": pick_latest, "all": pick_all}


def register_picker(name: str, picker: Picker) -> None:
    """Make `picker` selectable by `name` (it returns a subset of `lines.leaves`)."""
    if not isinstance(name, str) or not name:
        raise SampleError(f"picker name must be a non-empty str, got {name!r}")
    PICKERS[name] = picker


# -- one sample ----------------------------------------------------------------


def status_of(finish_reason: str) -> str:
    """A turn's finish reason as a sample status (module doc: Status)."""
    if finish_reason in COMPLETED_FINISH_REASONS:
        return "completed"
    if finish_reason in TRUNCATED_FINISH_REASONS:
        return "truncated"
    return "aborted"


def _kept_turns(checkpoints: Sequence[int], max_seq_len: int | None) -> int:
    """How many whole turns end at or before `max_seq_len`."""
    if max_seq_len is None:
        return len(checkpoints) - 1
    return bisect_right(checkpoints, max_seq_len) - 1


def _sample(
    lines: TreeLines,
    branch: Branch,
    claimed: set[tuple[int, int]],
    max_seq_len: int | None,
    reward: float | None,
    metadata: dict[str, Any],
    turn_rewards: Mapping[int, float],
    select: AgentFilter,
) -> Sample | None:
    traj = branch.trajectory
    turns = traj.turns
    owners = lines.owners[branch.id]
    line_end = len(turns)  # the line, or (agent filter) up to its last selected turn
    if select.active:
        picked = [i for i, t in enumerate(turns) if select.matches(t.lineage)]
        if not picked:
            return None
        line_end = picked[-1] + 1
    n_keep = min(_kept_turns(traj.checkpoints, max_seq_len), line_end)
    end = traj.checkpoints[n_keep]
    kept = turns[:n_keep]
    ids_view, lps_view, mask_view = traj.arrays(end)
    ids = np.array(ids_view, dtype=np.int32)
    mask = np.array(mask_view, dtype=np.uint8)
    lps = np.array(lps_view, dtype=np.float32)
    trained_before = 0
    while trained_before < n_keep and (owners[trained_before], trained_before) in claimed:
        trained_before += 1
    if select.active and trained_before == n_keep == line_end < len(turns):
        return None  # cut by the agent filter (not by length) to turns an earlier sample trains
    if trained_before:
        cut = traj.checkpoints[trained_before]
        mask[:cut] = 0
        lps[:cut] = 0.0
    for t in turns[trained_before:n_keep]:
        if not select.matches(t.lineage):  # another agent's turn: context here, trained nowhere
            mask[t.output_start:t.output_end] = 0
            lps[t.output_start:t.output_end] = 0.0
    claimed.update((owners[i], i) for i in range(trained_before, n_keep))
    index, table = weight_versions(kept, end)
    reason = None
    if n_keep < line_end:
        status = "truncated"
        if n_keep == 0:
            reason = f"first turn ends at {turns[0].end} tokens, past max_seq_len {max_seq_len}"
        else:
            reason = f"max_seq_len {max_seq_len}: kept {n_keep} of {len(turns)} turns ({end} tokens)"
    else:
        status = status_of(turns[n_keep - 1].finish_reason)
        if n_keep < len(turns):
            reason = f"agent filter: kept {n_keep} of {len(turns)} turns (the rest are other agents')"
    return Sample(
        token_ids=ids,
        loss_mask=mask,
        logprobs=lps,
        weight_version_index=index,
        version_table=table,
        turn_boundaries=[(t.prompt_start, t.output_start, t.output_end) for t in kept],
        status=status,
        reason=reason,
        reward=reward,
        turn_rewards=[turn_rewards.get(t.seq) for t in kept],
        turn_lineage=[None if t.lineage is None else t.lineage.to_dict() for t in kept],
        metadata=dict(metadata),
        diagnostics=[turn_diagnostics(t, owners[t.index]) for t in kept],
        path=lines.path(branch.id),
        routed_experts=line_rows(kept, end),
        sampling_support=line_support(kept, end),
    )


# -- the whole tree ------------------------------------------------------------


def _check_reward(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise SampleError(f"{where} must be a finite number, got {value!r}")
    return float(value)


def _rewards(reward: Any, kept: Sequence[int], leaves: Sequence[int]) -> dict[int, float | None]:
    """Reward per kept leaf: one number for all, or a mapping leaf id -> number."""
    if reward is None:
        return dict.fromkeys(kept)
    if not isinstance(reward, Mapping):
        value = _check_reward(reward, "reward")
        return dict.fromkeys(kept, value)
    unknown = [k for k in reward if k not in leaves]
    if unknown:
        raise SampleError(f"reward names {unknown!r}, which are not leaves (leaves: {list(leaves)})")
    return {k: (None if reward.get(k) is None else _check_reward(reward[k], f"reward[{k}]"))
            for k in kept}


def _as_tree(source: TrajectoryTree | Mapping[str, Any]) -> TrajectoryTree:
    if isinstance(source, TrajectoryTree):
        return source
    if isinstance(source, Mapping):
        return from_dict(source)
    raise SampleError(f"expected a TrajectoryTree or an exported dict, got {type(source).__name__}")


def build_samples(
    source: TrajectoryTree | Mapping[str, Any],
    *,
    picker: str = DEFAULT_PICKER,
    max_seq_len: int | None = None,
    reward: float | Mapping[int, float | None] | None = None,
    metadata: Mapping[str, Any] | None = None,
    turn_rewards: Mapping[int, float] | None = None,
    agent: AgentFilter | None = None,
) -> list[Sample]:
    """The training samples of a session (module doc), in leaf creation order.

    `source` is a `TrajectoryTree` or its `trajectory.export.to_dict` form (checked
    on import, raising `ExportError`). `reward` is one number for every sample
    or a mapping from leaf branch id to a number (leaves it omits get None);
    `metadata` is merged over the tree's metadata into every sample's;
    `turn_rewards` maps a committed turn's seq to its reward (`trajectory.turn_rewards`);
    `agent` selects lines and trains only the turns of one agent or kind (module doc).
    An unknown picker, a bad `max_seq_len`, reward or turn reward raises `SampleError`.
    """
    tree = _as_tree(source)
    if max_seq_len is not None and (
        isinstance(max_seq_len, bool) or not isinstance(max_seq_len, int) or max_seq_len < 1
    ):
        raise SampleError(f"max_seq_len must be an int >= 1, got {max_seq_len!r}")
    try:
        pick = PICKERS[picker]
    except (KeyError, TypeError):
        raise SampleError(f"unknown picker {picker!r}; known: {sorted(PICKERS)}") from None
    lines = tree_lines(tree)
    chosen = set(pick(lines))
    if not chosen <= set(lines.leaves):
        raise SampleError(f"picker {picker!r} chose non-leaves {sorted(chosen - set(lines.leaves))}")
    kept = [leaf for leaf in lines.leaves if leaf in chosen]
    rewards = _rewards(reward, kept, lines.leaves)
    per_turn = check_turn_rewards(turn_rewards, committed_seqs(tree.branches())) if turn_rewards else {}
    meta = {**tree.metadata, **(metadata or {})}
    claimed: set[tuple[int, int]] = set()
    select = agent or AgentFilter()
    built = (_sample(lines, tree.get(leaf), claimed, max_seq_len, rewards[leaf], meta, per_turn, select)
             for leaf in kept)
    return [s for s in built if s is not None]
