// One session: its branch tree (fork reasons and points, the lines the picker keeps),
// one line's tokens and conversation (its whole line, GET .../line: a fork's parent prefix
// and its turns included), the samples a trainer would get with their exactly-once count
// (coverage.js), and the turn in flight, live (live.js).
// At a turn's end the page reads the session and the shown line again and updates in
// place: the open tab, the scroll position, the clicked token and every token chunk that
// did not change stay (tokens.js redraws only changed or new chunks; their texts are the
// costly part, and only those are fetched again).
"use strict";

V.sessionPage = async function (app, sid) {
  const base = "/sessions/" + encodeURIComponent(sid);
  const q = new URLSearchParams(location.search);
  const pinned = q.has("branch");  // else the page follows the active branch
  const read = async () => {
    // the trajectory before the samples: a sample's line is then always in it (but a
    // branch made in between; coverage.js says so, and the next turn's end reads again)
    const [view, traj] = await Promise.all([V.api(base), V.api(base + "/trajectory")]);
    // the branch shown: the pinned one while it exists, else the active one; its whole
    // line from /line (the trajectory holds a fork's own part only)
    let selected = pinned ? parseInt(q.get("branch"), 10) : traj.active_branch;
    if (!traj.branches.some((b) => b.id === selected)) selected = traj.active_branch;
    const [line, got] = await Promise.all([V.readLine(sid, selected),
      V.api(base + "/samples?" + sp).then((r) => ({ samples: r.samples, sampleErr: null }),
        (e) => ({ samples: null, sampleErr: e }))]);
    return { view: view, traj: traj, line: line, samples: got.samples, sampleErr: got.sampleErr };
  };
  let meta;
  try { meta = await V.api("/ui/api/meta"); } catch (e) { V.error(app, e); return; }
  const picker = q.get("picker") || meta.default_picker;
  const maxLen = q.get("max_seq_len") || "";
  const sp = new URLSearchParams({ picker: picker });
  if (maxLen) sp.set("max_seq_len", maxLen);
  let data;
  try { data = await read(); } catch (e) { V.error(app, e); return; }

  const facts = V.el("p", { class: "kv", id: "session-facts" });
  const live = V.el("div", { id: "live" });
  const grid = V.el("div", { class: "grid" });
  app.append(V.el("h2", { id: "session-title", text: "Session " + sid }), facts, live, grid);
  const left = V.el("section", {}), right = V.el("section", {});
  grid.append(left, right);
  const tree = V.el("div", {}), samples = V.el("div", { id: "samples" }), sampleList = V.el("div", { id: "samples-list" });
  const diagTitle = V.el("h2", {}), diag = V.el("ul", { id: "diagnostics", class: "kv" });
  samples.append(samplesForm(meta, picker, maxLen, q), sampleList);
  left.append(V.el("h2", { text: "Branches" }), tree, V.el("h2", { text: "Samples" }), samples, diagTitle, diag);

  const lineTitle = V.el("h2", { id: "line-title" });
  const tabs = V.el("div", { class: "tabs" });
  const tokensPane = V.el("div", { id: "tokens-pane" });
  const convPane = V.el("div", { id: "conversation-pane", hidden: true });
  const show = (which) => {
    tokensPane.hidden = which !== "tokens"; convPane.hidden = which !== "conversation";
    for (const b of tabs.children) b.classList.toggle("on", b.dataset.tab === which);
  };
  tabs.append(V.el("button", { text: "Tokens", data: { tab: "tokens" }, onclick: () => show("tokens") }),
    V.el("button", { text: "Conversation", data: { tab: "conversation" }, onclick: () => show("conversation") }));
  right.append(lineTitle, tabs, tokensPane, convPane);
  show("tokens");
  let tokenView = null, conv = null, drawnTurns = null;

  const render = (d) => {
    const { view, traj, line } = d;
    drawnTurns = view.turns_total;  // the live stream's hello says when it is stale
    const selected = line.id;
    facts.textContent =
      `state ${view.state} · home ${view.home || "-"} · ${view.turns} turns on the active line · ${view.stored_tokens} stored tokens · ` +
      `reward ${view.reward === null ? "-" : view.reward} · aborts ${view.control.aborts} · resubmits ${view.control.resubmits} · ` +
      `metadata ${V.short(view.metadata, 200)}`;
    const kept = new Set(d.samples ? d.samples.map((s) => s.path[s.path.length - 1]) : []);
    V.clear(tree).appendChild(branchTree(traj, view, kept, selected, (id) => {
      const p = new URLSearchParams(q); p.set("branch", id); location.search = p.toString();
    }));
    V.clear(sampleList);
    if (d.sampleErr) V.error(sampleList, d.sampleErr);
    else sampleList.append(...sampleRows(d.samples), V.coverageView(traj, d.samples));
    diagTitle.textContent = `Diagnostics (${view.diagnostics.length + view.diagnostics_dropped})`;
    V.clear(diag).append(...view.diagnostics.map((x) => V.el("li", { text: V.short(x, 300) })));
    lineTitle.textContent = `Line: branch ${line.id} (${line.reason})`;
    if (!tokenView) {
      tokenView = V.renderLine(tokensPane, sid, line);
      conv = conversation(convPane, (i) => { show("tokens"); tokenView.reveal(i); });
    } else {
      tokenView.update(line);
    }
    conv.update(line);
  };
  render(data);

  // turn ends come while a read may still run: one read at a time, and one more after it
  let reading = false, again = false, reads = 0;
  const changed = async () => {
    if (reading) { again = true; return; }
    reading = true;
    do {
      again = false;
      try { render(await read()); } catch (e) { V.status("could not read the session again: " + e.message); }
    } while (again);
    reading = false;
    document.body.dataset.reads = String(++reads);  // how many times it was read again (for tests)
  };
  V.followLive(live, base, changed, () => drawnTurns);
};

function branchTree(traj, view, kept, selected, choose) {
  const byParent = new Map();
  for (const b of traj.branches) {
    const k = b.parent_id === null ? "root" : b.parent_id;
    if (!byParent.has(k)) byParent.set(k, []);
    byParent.get(k).push(b);
  }
  const summary = new Map(view.branches.map((b) => [b.id, b]));
  const node = (b) => {
    const s = summary.get(b.id) || {};
    const label = b.parent_id === null
      ? `branch ${b.id}: root`
      : `branch ${b.id}: ${b.reason} of ${b.parent_id} after turn ${b.fork_checkpoint} (token ${b.fork_index})`;
    const span = V.el("span", { class: "node" + (b.id === selected ? " selected" : "") + (b.id === traj.active_branch ? " active" : ""),
      data: { branch: b.id, reason: b.reason }, onclick: () => choose(b.id) },
      label, V.el("span", { class: "muted", text: ` · ${s.turns ?? b.turns.length} turns · ${s.tokens ?? b.token_ids.length} tokens` }),
      b.id === traj.active_branch ? V.el("span", { class: "badge", text: "active" }) : null,
      kept.has(b.id) ? V.el("span", { class: "badge kept", text: "kept by picker" }) : null);
    const li = V.el("li", {}, span);
    const kids = byParent.get(b.id) || [];
    if (kids.length) { const ul = V.el("ul", {}); kids.forEach((c) => ul.appendChild(node(c))); li.appendChild(ul); }
    return li;
  };
  const ul = V.el("ul", {});
  (byParent.get("root") || []).forEach((b) => ul.appendChild(node(b)));
  return V.el("div", { class: "tree", id: "branch-tree" }, ul);
}

function samplesForm(meta, picker, maxLen, q) {
  const sel = V.el("select", { name: "picker" });
  for (const p of meta.pickers) { const o = V.el("option", { value: p, text: p }); if (p === picker) o.selected = true; sel.appendChild(o); }
  const len = V.el("input", { name: "max_seq_len", type: "number", min: 1, value: maxLen, placeholder: "none" });
  return V.el("form", { class: "filters", onsubmit: (ev) => {
    ev.preventDefault();
    const p = new URLSearchParams(q); p.set("picker", sel.value);
    if (len.value) p.set("max_seq_len", len.value); else p.delete("max_seq_len");
    location.search = p.toString();
  } }, V.el("label", {}, "picker ", sel), V.el("label", {}, "max_seq_len ", len), V.el("button", { type: "submit", text: "Show" }));
}

function sampleRows(samples) {
  const rows = [];
  let trained = 0;
  for (const s of samples) {
    const n = s.loss_mask.length, on = s.loss_mask.reduce((a, b) => a + b, 0);
    trained += on;
    const bar = V.el("div", { class: "maskbar", title: "trained tokens of this sample (green)" });
    let k = 0;
    while (k < n) {
      let j = k; while (j < n && s.loss_mask[j] === s.loss_mask[k]) j++;
      const seg = V.el("div", { class: s.loss_mask[k] ? "on" : "off" });
      seg.style.width = (100 * (j - k) / n) + "%";
      bar.appendChild(seg); k = j;
    }
    rows.push(V.el("div", { class: "sample", data: { leaf: s.path[s.path.length - 1] } },
      V.el("div", { class: "kv", text: `line ${s.path.join(" → ")} · ${n} tokens · ${on} trained · ${s.turn_boundaries.length} turns · ` +
        `status ${s.status}${s.reason ? " (" + s.reason + ")" : ""} · reward ${s.reward === null ? "-" : s.reward}` }), bar));
  }
  rows.push(V.el("p", { class: "muted", id: "samples-summary", text: `${samples.length} samples, ${trained} trained tokens in all` }));
  return rows;
}

// the line's messages, turn by turn; when the same line grows only its new turns are added
function conversation(pane, reveal) {
  const box = V.el("div", { id: "conversation" });
  pane.appendChild(box);
  let shown = null, turns = 0;
  return {
    update: (line) => {
      if (shown !== line.id) { V.clear(box); shown = line.id; turns = 0; }
      for (const t of line.turns.slice(turns)) {
        for (const m of t.request_messages || []) box.appendChild(message(m, null));
        if (t.assistant_message) {
          box.appendChild(message(t.assistant_message, V.el("a", { href: "#", class: "to-tokens", data: { at: t.output_start },
            text: `→ its ${t.output_end - t.output_start} tokens (${t.output_start}-${t.output_end})`,
            onclick: (ev) => { ev.preventDefault(); reveal(t.output_start); } })));
        }
      }
      turns = line.turns.length;
    },
  };
}

function message(m, link) {
  const div = V.el("div", { class: "msg " + (m.role || "") }, V.el("span", { class: "role", text: m.role || "?" }), link);
  const text = (v) => typeof v === "string" ? v : JSON.stringify(v, null, 1);
  if (m.reasoning_content) div.appendChild(V.el("pre", { class: "muted", text: "[reasoning] " + m.reasoning_content }));
  if (m.content !== undefined && m.content !== null) div.appendChild(V.el("pre", { text: text(m.content) }));
  for (const c of m.tool_calls || []) div.appendChild(V.el("pre", { class: "kv", text: `call ${c.id}: ${c.function ? c.function.name + " " + c.function.arguments : text(c)}` }));
  if (m.tool_call_id) div.appendChild(V.el("div", { class: "kv", text: "answers call " + m.tool_call_id }));
  return div;
}
