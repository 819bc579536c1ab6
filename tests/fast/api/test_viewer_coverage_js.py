"""The viewer's exactly-once count (`ui_static/coverage.js`), run in node on trees and
samples the library builds: docs/samples.md's worked example, a constructed double
count, a gap and a trained prompt token, and random trees with forks into a prompt.
Without node the tests skip here; under CI (`CI` set) that is a failure (`.ci/run`
installs nodejs)."""

from __future__ import annotations

import copy
import json
import os
import random
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from trajectory import TrajectoryTree, build_samples
from trajectory.export import to_dict
from trajectory.sample_formats import samples_to_json

COVERAGE_JS = Path(__file__).resolve().parents[3] / "session_server" / "api" / "ui_static" / "coverage.js"
RUN = ("const c = require(process.argv[1]); let d = '';"
       "process.stdin.on('data', (x) => { d += x; }).on('end', () => {"
       "  const cases = JSON.parse(d);"
       "  console.log(JSON.stringify(cases.map(([t, s]) => c.coverage(t, s))));"
       "});")


def _node() -> str:
    node = shutil.which("node")
    if node is None:
        if os.environ.get("CI"):
            pytest.fail("CI: no node on PATH: .ci/run installs nodejs")
        pytest.skip("node is not installed (apt-get install nodejs)")
    return node


def coverage(*cases: tuple[dict[str, Any], list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """coverage.js's answer for each (trajectory export, samples) pair, from one node run."""
    out = subprocess.run([_node(), "-e", RUN, str(COVERAGE_JS)], input=json.dumps(cases), capture_output=True,
                         text=True, timeout=60, check=False)
    assert out.returncode == 0, out.stderr
    result: list[dict[str, Any]] = json.loads(out.stdout)
    return result


def samples_of(tree: TrajectoryTree, **kw: Any) -> list[dict[str, Any]]:
    """The samples as `GET /sessions/{sid}/samples` answers them (the same JSON writer)."""
    got: list[dict[str, Any]] = json.loads(samples_to_json(build_samples(tree, **kw)))["samples"]
    return got


def worked_example() -> TrajectoryTree:
    """docs/samples.md's worked example: turn 1 cut off, then retried on branch 1."""
    tree = TrajectoryTree()

    def turn(prompt: list[int], out: list[int], finish: str = "stop", version: int = 7) -> None:
        tree.active.trajectory.commit_turn(prompt, out, [-0.5] * len(out), finish_reason=finish,
                                           weight_version=version)

    turn([1, 2], [10, 11])
    turn([3], [12, 13], "length")
    tree.rollback(1)
    turn([3], [14, 15], "tool_calls", version=8)
    return tree


def test_the_worked_example_is_exactly_once_under_every_picker_and_a_cut() -> None:
    tree = worked_example()
    export = to_dict(tree)
    every = samples_of(tree, picker="all")
    assert [s["loss_mask"] for s in every] == [[0, 0, 1, 1, 0, 1, 1], [0, 0, 0, 0, 0, 1, 1]]  # the doc's table
    latest, cut = samples_of(tree, picker="latest"), samples_of(tree, picker="all", max_seq_len=5)
    got = coverage((export, every), (export, latest), (export, cut))
    # all: 10 11 (shared, branch 0's), 12 13 (branch 0), 14 15 (branch 1's, at positions 5 6)
    assert got[0] == {"sampled": 6, "once": 6, "lines": 2, "problems": []}
    assert got[1] == {"sampled": 4, "once": 4, "lines": 1, "problems": []}  # branch 0's retried turn dropped
    assert got[2] == {"sampled": 2, "once": 2, "lines": 2, "problems": []}  # turn 0 only, in both lines


def test_a_shared_token_trained_twice_a_gap_and_a_trained_prompt_token_are_each_listed() -> None:
    tree = worked_example()
    export = to_dict(tree)
    every = samples_of(tree, picker="all")
    twice = copy.deepcopy(every)
    twice[1]["loss_mask"][2:4] = [1, 1]  # the shared turn 0 trained again in branch 1's sample
    gap = copy.deepcopy(every)
    gap[1]["loss_mask"][5] = 0  # branch 1's first sampled token trained nowhere
    prompt = copy.deepcopy(every)
    prompt[0]["loss_mask"][4] = 1  # a prompt token (mask 0 on its line) trained
    got = coverage((export, twice), (export, gap), (export, prompt))
    assert got[0]["problems"] == [{"position": 2, "line": 0, "count": 2, "sampled": True},
                                  {"position": 3, "line": 0, "count": 2, "sampled": True}]
    assert (got[0]["sampled"], got[0]["once"]) == (6, 4)
    assert got[1]["problems"] == [{"position": 5, "line": 1, "count": 0, "sampled": True}]
    assert (got[1]["sampled"], got[1]["once"]) == (6, 5)
    assert got[2]["problems"] == [{"position": 4, "line": 0, "count": 1, "sampled": False}]
    assert (got[2]["sampled"], got[2]["once"]) == (6, 6)


def random_tree(rng: random.Random) -> TrajectoryTree:
    """Turns, retries, switches back to older branches and forks that share part of the
    parent's next prompt (a template rewrite), at random."""
    tree = TrajectoryTree()
    tok = iter(range(100, 10**6))
    for _ in range(rng.randint(3, 14)):
        traj = tree.active.trajectory
        op = rng.random()
        if op < 0.15 and traj.num_turns:
            tree.rollback(rng.randint(0, traj.num_turns - 1))
        elif op < 0.25 and len(tree) > 1:
            tree.activate(rng.choice(tree.branches()).id)
        elif op < 0.35 and traj.num_turns >= 1:
            k = rng.randint(0, traj.num_turns - 1)
            nxt = traj.turns[k]  # the turn after checkpoint k
            shared = rng.randint(nxt.prompt_start, nxt.output_start)  # into the next prompt
            tree.branch_from(tree.active_id, k, "template_rewrite", shared=shared)
        prompt = [next(tok) for _ in range(rng.randint(1 if tree.active.trajectory.num_turns == 0 else 0, 4))]
        out = [next(tok) for _ in range(rng.randint(1, 5))]
        tree.active.trajectory.commit_turn(prompt or [next(tok)], out, [-0.1] * len(out), finish_reason="stop",
                                           weight_version=1)
    return tree


def sampled_tokens(samples: list[dict[str, Any]]) -> set[tuple[int, int]]:
    """(owner branch, position) of every sampled token the samples hold, from their own
    turn boundaries and per-turn owners: another way to count than coverage.js's."""
    out = set()
    for s in samples:
        for (_, start, end), diag in zip(s["turn_boundaries"], s["diagnostics"], strict=True):
            out.update((diag["branch"], p) for p in range(start, end))
    return out


def test_random_trees_with_forks_into_a_prompt_are_exactly_once_and_counted_as_the_samples_own_turns_say() -> None:
    rng = random.Random(20240607)
    cases, want, into_prompt = [], [], 0
    for _ in range(60):
        tree = random_tree(rng)
        export = json.loads(json.dumps(to_dict(tree)))
        ends = {b["id"]: {t["end"] for t in b["turns"]} | {b["fork_index"]} for b in export["branches"]}
        into_prompt += sum(1 for b in export["branches"] if b["parent_id"] is not None
                           and b["fork_index"] not in ends[b["parent_id"]] and b["turns"])
        for kw in ({"picker": "all"}, {"picker": "latest"}, {"picker": "all", "max_seq_len": rng.randint(4, 40)}):
            samples = samples_of(tree, **kw)
            cases.append((export, samples))
            want.append(len(sampled_tokens(samples)))
    assert into_prompt >= 5  # the scene has what the test claims: lines forked inside a prompt
    got = coverage(*cases)
    assert [g["problems"] for g in got] == [[] for _ in got]
    assert [g["sampled"] for g in got] == want
    assert [g["once"] for g in got] == want
    assert sum(want) > 500  # the trees are big enough to say something


def test_a_sample_of_a_branch_the_trajectory_lacks_is_an_error_not_a_count() -> None:
    tree = worked_example()
    export = to_dict(tree)
    export["branches"] = export["branches"][:1]
    out = subprocess.run([_node(), "-e", RUN, str(COVERAGE_JS)],
                         input=json.dumps([(export, samples_of(tree, picker="all"))]),
                         capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode != 0 and "branch 1 is not in the trajectory" in out.stderr
