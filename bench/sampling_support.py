"""Sampling support: what it costs per token, stored and in samples (library level, no server).

Sessions are built as the server commits turns (`LinearTrajectory.commit_turn` with a
`SupportCSR` per turn): a 1,600-token first prompt, then 8 turns of ~200 tool-output
tokens and ~160 sampled tokens. Two support shapes at k = 20:

- ``full``: every support has 20 ids (top_k = 20 truncating alone: the bound, 4k + 4 B);
- ``mixed``: sizes uniform in [1, 20] (top_p / min_p cutting inside the top 20).

Reported per sampled token: the stored CSR bytes (turn records); per sample token: the
safetensors / npz / json payload with and without the support, and build + serialise time.

    python bench/sampling_support.py --json bench/results/sampling_support.json
    python bench/sampling_support.py --quick
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trajectory.sample_formats import SERIALIZERS  # noqa: E402
from trajectory.samples import build_samples  # noqa: E402
from trajectory.support import SupportCSR  # noqa: E402
from trajectory.tree import TrajectoryTree  # noqa: E402

K = 20


def _session(rng: np.random.Generator, shape: str | None) -> TrajectoryTree:
    tree = TrajectoryTree()
    traj = tree.active.trajectory
    for turn in range(8):
        prompt = rng.integers(0, 150_000, 1600 if turn == 0 else int(rng.integers(150, 250)), dtype=np.int32)
        n = int(rng.integers(120, 200))
        sampled = rng.integers(0, 150_000, n, dtype=np.int32)
        support = None
        if shape is not None:
            sizes = np.full(n, K) if shape == "full" else rng.integers(1, K + 1, n)
            offsets = np.zeros(n + 1, dtype=np.int32)
            np.cumsum(sizes, out=offsets[1:])
            ids = rng.integers(0, 150_000, int(offsets[-1]), dtype=np.int32)
            ids[offsets[:-1]] = sampled  # each token's support holds it
            support = SupportCSR(ids, offsets)
        traj.commit_turn(prompt, sampled, rng.uniform(-5, 0, n).astype(np.float32), finish_reason="stop",
                         sampling_support=support)
    return tree


def run(sessions: int) -> dict[str, object]:
    out: dict[str, object] = {"k": K, "sessions": sessions}
    for shape in (None, "full", "mixed"):
        rng = np.random.default_rng(0)
        trees = [_session(rng, shape) for _ in range(sessions)]
        sampled = sum(t.num_sampled for tree in trees for t in tree.active.trajectory.turns)
        stored = sum(t.sampling_support.nbytes for tree in trees for t in tree.active.trajectory.turns
                     if t.sampling_support is not None)
        t0 = time.perf_counter()
        samples = [s for tree in trees for s in build_samples(tree)]
        t_build = time.perf_counter() - t0
        tokens = sum(len(s) for s in samples)
        row: dict[str, object] = {"sampled_tokens": sampled, "sample_tokens": tokens,
                                  "stored_bytes_per_sampled_token": round(stored / sampled, 2),
                                  "build_s": round(t_build, 3)}
        for fmt, dump in SERIALIZERS.items():
            t0 = time.perf_counter()
            payload = dump(samples)
            row[f"{fmt}_bytes_per_token"] = round(len(payload) / tokens, 2)
            row[f"{fmt}_s"] = round(time.perf_counter() - t0, 3)
        out[shape or "off"] = row
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sessions", type=int, default=200)
    ap.add_argument("--quick", action="store_true", help="20 sessions")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    result = run(20 if args.quick else args.sessions)
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")


if __name__ == "__main__":
    main()
