"""`bench/samples.py --quick --json` runs in seconds and writes every documented key."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]

THROUGHPUT_KEYS = {
    "sessions", "turns_per_session", "committed_tokens", "samples", "sample_tokens", "trainable_tokens",
    "build_trees_s", "build_samples_s", "safetensors_s", "wall_s", "tokens_per_s",
    "build_samples_tokens_per_s", "safetensors_tokens_per_s", "load_s", "load_tokens_per_s",
    "payload_bytes", "payload_bytes_per_token",
}
FORK_KEYS = {
    "line_tokens", "forks", "fork_turns", "unique_tokens", "forked_bytes", "linear_bytes",
    "forked_bytes_per_token", "linear_bytes_per_token", "ratio", "target_ratio", "meets_target",
}


def test_bench_samples_quick_writes_its_json(tmp_path: Path) -> None:
    out = tmp_path / "samples.json"
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "samples.py"), "--quick", "--json", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr
    data = json.loads(out.read_text())
    assert set(data) == {"quick", "seed", "throughput", "fork_memory", "peak_rss_mib", "peak_rss_mib_at_start"}
    assert set(data["throughput"]) == THROUGHPUT_KEYS
    assert set(data["fork_memory"]) == FORK_KEYS
    tp, fm = data["throughput"], data["fork_memory"]
    assert data["quick"] is True and tp["samples"] >= tp["sessions"] > 0
    assert 0 < tp["trainable_tokens"] < tp["sample_tokens"] <= tp["committed_tokens"]
    assert tp["tokens_per_s"] > 0 and data["peak_rss_mib"] > 0
    assert fm["forks"] == 8 and fm["unique_tokens"] > fm["line_tokens"]
    # the tree holds at least the 9 bytes a token needs (int32 id, float32 logprob, uint8 mask)
    assert fm["linear_bytes_per_token"] >= 9 and fm["forked_bytes_per_token"] >= 9
    assert fm["ratio"] == fm["forked_bytes_per_token"] / fm["linear_bytes_per_token"]
