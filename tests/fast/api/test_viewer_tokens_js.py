"""The token view's chunk keys (`ui_static/tokens.js`, run in node): a chunk is drawn
again at a turn's end only when its key changed, so the key must change with the tool
output the server marks (`tool_spans` of `GET /sessions/{sid}/line`) and only for the
chunks those spans touch. Without node the tests skip here (a failure under CI)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

from .test_viewer_coverage_js import _node

TOKENS_JS = Path(__file__).resolve().parents[3] / "session_server" / "api" / "ui_static" / "tokens.js"
RUN = ("global.V = {}; require(process.argv[1]); let d = '';"
       "process.stdin.on('data', (x) => { d += x; }).on('end', () => {"
       "  console.log(JSON.stringify(JSON.parse(d).map((line) => {"
       "    const kinds = V.tokenKinds(line), marks = V.lineMarks(line);"
       "    return { kinds: kinds, keys: V.lineChunks(line).map((c) => V.chunkKey(line, c, kinds, marks)) };"
       "  })));"
       "});")


def line(tool_spans: list[list[int]]) -> dict[str, Any]:
    """Three turns of 50 prompt and 20 sampled tokens (six chunks: each turn's prompt,
    then its output), the tool output the server found marked by `tool_spans`."""
    turns, at = [], 0
    for k in range(3):
        turns.append({"index": k, "seq": k, "prompt_start": at, "output_start": at + 50, "output_end": at + 70,
                      "end": at + 70, "finish_reason": "stop", "weight_version": 1,
                      "weight_spans": [[at + 50, at + 70, 1]], "engine": "e", "repair_tokens": 0, "extra": {}})
        at += 70
    mask = [0] * at
    for t in turns:
        mask[t["output_start"]:t["output_end"]] = [1] * 20
    return {"id": 0, "token_ids": [1000 + i for i in range(at)], "loss_mask": mask, "logprobs": [-0.5] * at,
            "turns": turns, "tool_spans": tool_spans}


def keyed(*lines: dict[str, Any]) -> list[dict[str, Any]]:
    out = subprocess.run([_node(), "-e", RUN, str(TOKENS_JS)], input=json.dumps(lines), capture_output=True,
                         text=True, timeout=60, check=False)
    assert out.returncode == 0, out.stderr
    result: list[dict[str, Any]] = json.loads(out.stdout)
    return result


def test_a_chunks_key_changes_with_its_tool_output_and_no_other_chunks_does() -> None:
    # no tool output; turn 1's prompt (chunk 2, tokens 70-120) holding one; the same span grown
    plain, marked, grown = keyed(line([]), line([[80, 90]]), line([[80, 95]]))
    assert [i for i, k in enumerate(marked["kinds"]) if k == "tool"] == list(range(80, 90))
    assert plain["kinds"][80:90] == ["template"] * 10  # what the key must tell apart
    assert len(plain["keys"]) == len(marked["keys"]) == len(grown["keys"]) == 6
    for a, b in ((plain, marked), (marked, grown)):
        assert [k for k in range(6) if a["keys"][k] != b["keys"][k]] == [2]
