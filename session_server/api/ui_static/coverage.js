// "Exactly once", counted rather than claimed: how many of the samples a trainer would
// get train each sampled token of the lines they come from (docs/samples.md).
//
// A token shared by several lines (the turns before a fork) is one token: it sits in the
// buffer of the branch that committed it, at the same position in every line through
// that branch, so it is counted at (owning branch, position). The lines are rebuilt from
// GET /sessions/{sid}/trajectory (export version 2: each branch holds its own tokens from
// its fork point on); which tokens are sampled comes from there (the line's loss mask),
// never from the samples being checked. A sample covers its leaf's line up to its own
// length (max_seq_len may cut whole turns off the end: those tokens are in no sample by
// design, and are not counted). Pure computation here; the page draws the result.
// Runs in node too (tests/fast/api/test_viewer_coverage_js.py).
"use strict";

(function (out) {
  // the segments of a leaf's line: positions [from, to) read from `branch`'s own arrays.
  // Position p is the deepest branch's on the path whose fork point is at or before p (a
  // branch may fork from its parent before the parent's own fork point: a rollback)
  function segments(byId, leaf) {
    const out = [];
    let bound = Infinity;
    for (let id = leaf; id !== null && id !== undefined;) {
      const b = byId.get(id);
      if (!b) throw new Error(`branch ${id} is not in the trajectory (read again: a turn came in between)`);
      const to = Math.min(bound, b.fork_index + b.loss_mask.length);
      if (b.fork_index < to) out.push({ branch: b, from: b.fork_index, to: to });
      bound = Math.min(bound, b.fork_index);
      id = b.parent_id;
    }
    return out;
  }

  // {sampled, once, lines, problems: [{position, line, count, sampled}]}: `sampled` tokens of
  // the kept lines (within their samples' lengths), `once` of them trained exactly once; a
  // problem is a sampled token trained zero times or more than once, or a token that is not
  // sampled (mask 0 on its line) yet trained. `line` is the branch that owns the token.
  function coverage(traj, samples) {
    const byId = new Map(traj.branches.map((b) => [b.id, b]));
    const tally = new Map();  // owner id -> {sampled: Uint8Array, count: Int32Array}, by own index
    const of = (b) => {
      let t = tally.get(b.id);
      if (!t) {
        t = { branch: b, sampled: new Uint8Array(b.loss_mask.length), count: new Int32Array(b.loss_mask.length) };
        tally.set(b.id, t);
      }
      return t;
    };
    const leaves = new Set();
    for (const s of samples) {
      const leaf = s.path[s.path.length - 1];
      leaves.add(leaf);
      const n = s.loss_mask.length;
      for (const seg of segments(byId, leaf)) {
        const t = of(seg.branch), base = seg.branch.fork_index, mask = seg.branch.loss_mask;
        for (let p = seg.from, end = Math.min(seg.to, n); p < end; p++) {
          if (mask[p - base]) t.sampled[p - base] = 1;
          if (s.loss_mask[p]) t.count[p - base] += 1;
        }
      }
    }
    let sampled = 0, once = 0;
    const problems = [];
    for (const [id, t] of [...tally.entries()].sort((a, b) => a[0] - b[0])) {
      const base = t.branch.fork_index;
      for (let k = 0; k < t.count.length; k++) {
        const c = t.count[k];
        if (t.sampled[k]) {
          sampled++;
          if (c === 1) once++;
          else problems.push({ position: base + k, line: id, count: c, sampled: true });
        } else if (c > 0) {
          problems.push({ position: base + k, line: id, count: c, sampled: false });
        }
      }
    }
    problems.sort((a, b) => a.position - b.position || a.line - b.line);
    return { sampled: sampled, once: once, lines: leaves.size, problems: problems };
  }

  // the result as the samples panel shows it: "exactly once" only when it holds
  function view(traj, samples, shown) {
    let r;
    try { r = coverage(traj, samples); } catch (e) {
      return V.el("p", { class: "err", id: "samples-coverage", text: "exactly-once check: " + e.message });
    }
    const limit = shown || 50;
    const box = V.el("div", { id: "samples-coverage", class: r.problems.length ? "coverage bad" : "coverage ok",
      data: { sampled: r.sampled, once: r.once, problems: r.problems.length } });
    if (!r.problems.length && !r.sampled) {
      box.appendChild(V.el("p", { class: "muted", text: "no sampled tokens in these samples: nothing to train, nothing to count" }));
      return box;
    }
    if (!r.problems.length) {
      box.appendChild(V.el("p", { text: `exactly once: each of the ${r.sampled} sampled tokens of the ${r.lines} kept lines ` +
        "is trained in exactly one sample (counted here from the samples' loss masks)" }));
      return box;
    }
    box.appendChild(V.el("p", { text: `NOT exactly once: ${r.problems.length} tokens (${r.once} of ${r.sampled} ` +
      "sampled tokens are trained exactly once):" }));
    const ul = V.el("ul", { id: "coverage-problems", class: "kv" });
    for (const p of r.problems.slice(0, limit)) {
      ul.appendChild(V.el("li", { data: { at: p.position, line: p.line, count: p.count },
        text: `token ${p.position} of line ${p.line}: trained ${p.count} times` + (p.sampled ? "" : " (not a sampled token)") }));
    }
    if (r.problems.length > limit) ul.appendChild(V.el("li", { class: "muted", text: `… and ${r.problems.length - limit} more` }));
    box.appendChild(ul);
    return box;
  }

  out.coverage = coverage;
  out.coverageView = view;
})(typeof V === "undefined" ? module.exports : V);
