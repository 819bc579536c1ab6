"""`bench/routing_replay.py --quick --json` runs and writes every documented key."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
PHASE_KEYS = {"routing_replay", "sessions", "turns", "errors", "sampled_tokens", "sampled_tokens_per_turn",
              "wall_s", "turns_per_s", "sampled_tokens_per_s", "health_ms", "load_avg_1m", "server_loop_lag_ms"}
LAG_KEYS = {"ticks", "p50", "p99", "max", "stalls", "stalled_ms", "stalled_on_cpu_ms", "stalled_runqueue_ms",
            "stalled_blocked_ms"}
STORED_KEYS = {"dtype", "routed_bytes", "positions", "sampled_tokens", "bytes_per_position",
               "bytes_per_sampled_token", "target_bytes_per_token", "meets_target"}
RSS_KEYS = {"routing_replay", "sessions", "turns", "errors", "sampled_tokens", "wall_s", "rss_mib_at_start",
            "rss_mib", "peak_rss_mib"}


def test_bench_routing_replay_quick_writes_its_json(tmp_path: Path) -> None:
    out = tmp_path / "r3.json"
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "routing_replay.py"), "--quick", "--json", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=280)
    assert done.returncode == 0, done.stderr[-2000:]
    data = json.loads(out.read_text())
    assert set(data) == {"quick", "model", "engine", "server_processes", "r3_on", "r3_off",
                         "turns_per_s_ratio_on_off", "rss", "wall_s", "legs", "median"}
    on, off = data["r3_on"], data["r3_off"]
    assert set(on) == PHASE_KEYS | {"stored"} and set(off) == PHASE_KEYS
    # the server's own loop was watched from inside (bench/_loopwatch.py), every leg listed
    assert set(on["server_loop_lag_ms"]) == LAG_KEYS and set(off["server_loop_lag_ms"]) == LAG_KEYS
    assert [leg["routing_replay"] for leg in data["legs"]] == [True, False]
    assert set(data["median"]) == {"r3_on", "r3_off", "turns_per_s_ratio_on_off", "health_p99_ratio_on_off"}
    assert set(on["stored"]) == STORED_KEYS and set(data["rss"]) == {"r3_on", "r3_off"}
    assert all(set(v) == RSS_KEYS for v in data["rss"].values())
    assert on["errors"] == {} and off["errors"] == {} and on["turns"] == off["turns"] > 0
    # 60 layers x top-8 of 128 experts as uint8: 480 bytes per position, the issue's <= 500
    assert on["stored"]["dtype"] == "uint8" and on["stored"]["bytes_per_position"] == 480
    assert on["stored"]["meets_target"] is True
