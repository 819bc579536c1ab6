"""The token view's chunk keys (`ui_static/tokens.js`, run in node): a chunk is drawn
again at a turn's end only when its key changed, so the key must change with the tool
output the server marks (`tool_spans` of `GET /sessions/{sid}/line`) and only for the
chunks those spans touch; and a chunk's /tokens answer that comes after an update removed
the chunk is dropped. Without node the tests skip here (a failure under CI)."""

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


# a DOM just big enough for `V.renderLine` in node: nodes with children, dataset, style
# and isConnected; the observer and the /tokens fetch are driven by the script
FAKE_DOM = r"""
class Node {
  constructor(tag) { this.tag = tag; this.children = []; this.parent = null; this.dataset = {}; this._text = "";
    this.style = { setProperty() {} }; const cls = new Set(); this.classList = {
      add: (c) => cls.add(c), remove: (c) => cls.delete(c), contains: (c) => cls.has(c), toggle() {} }; }
  appendChild(c) { if (c.tag === "#fragment") { for (const x of [...c.children]) this.appendChild(x); c.children = []; return c; }
    if (c.parent) c.remove(); c.parent = this; this.children.push(c); return c; }
  removeChild(c) { this.children.splice(this.children.indexOf(c), 1); c.parent = null; return c; }
  remove() { if (this.parent) this.parent.removeChild(this); }
  append(...cs) { for (const c of cs) this.appendChild(c); }
  get firstChild() { return this.children[0] || null; }
  get lastElementChild() { return this.children[this.children.length - 1] || null; }
  get isConnected() { let n = this; while (n.parent) n = n.parent; return n === ROOT; }
  set textContent(t) { this.children = []; this._text = t; } get textContent() { return this._text; }
  set className(c) { for (const x of String(c).split(" ")) if (x) this.classList.add(x); }
  querySelectorAll() { return []; } addEventListener() {} setAttribute() {} scrollIntoView() {}
  get offsetHeight() { return 10; }
}
const ROOT = new Node("body");
global.document = { createElement: (t) => new Node(t), createDocumentFragment: () => new Node("#fragment") };
let observe = null;
global.IntersectionObserver = class { constructor(cb) { observe = cb; } observe() {} unobserve() {} };
global.V = {
  el: (tag, attrs) => { const n = new Node(tag); for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "text") n.textContent = String(v); else if (k === "class") n.className = v;
    else if (k === "data") Object.assign(n.dataset, v); } return n; },
  clear: (n) => { n.children = []; return n; },
  shown: (t) => t,
};
require(process.argv[1]);
const errors = [];
process.on("unhandledRejection", (e) => errors.push(String(e && e.stack || e)));
let d = "";
process.stdin.on("data", (x) => { d += x; }).on("end", async () => {
  const [long, short] = JSON.parse(d);
  const waiting = [];
  V.api = () => new Promise((resolve) => waiting.push(resolve));
  V.MAX_TOKENS = 0;  // every loaded chunk not near view is emptied at once
  const holder = new Node("div"); ROOT.appendChild(holder);
  const view = V.renderLine(holder, "s", long);
  const box = view.box, last = box.children[box.children.length - 1];
  observe([{ target: last, isIntersecting: true }]);  // its /tokens fetch is in flight
  view.update(short);  // the line has fewer chunks now: that one is removed
  for (const resolve of waiting) resolve({ texts: Array(20).fill("x"), parts: [] });  // its 20 tokens
  await new Promise((r) => setTimeout(r, 0));
  console.log(JSON.stringify({ errors, chunks: box.children.length, removed_connected: last.isConnected,
                               removed_loaded: last.dataset.loaded || null, removed_children: last.children.length }));
});
"""


def test_a_fill_in_flight_for_a_chunk_the_update_removed_writes_nothing_and_unloads_nothing() -> None:
    """A chunk's /tokens fetch still in flight when the line's update removes that chunk:
    its answer is dropped (the detached node is not filled, its index not counted as
    loaded), so the trim after it never tries to empty a chunk that is not there."""
    long, short = line([]), line([])
    for key in ("token_ids", "loss_mask", "logprobs"):
        short[key] = short[key][:140]
    short["turns"] = short["turns"][:2]
    out = subprocess.run([_node(), "-e", FAKE_DOM, str(TOKENS_JS)], input=json.dumps([long, short]),
                         capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    assert got["chunks"] == 4 and got["removed_connected"] is False, got
    assert got["errors"] == [], got["errors"]
    assert got["removed_loaded"] is None and got["removed_children"] == 0, got
