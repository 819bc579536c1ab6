// One session: its branch tree (fork reasons and points, the lines the picker keeps),
// one line's tokens and conversation, the samples a trainer would get, and the turn in
// flight, live (server-sent events from GET /sessions/{sid}/live).
"use strict";

V.sessionPage = async function (app, sid) {
  const base = "/sessions/" + encodeURIComponent(sid);
  const q = new URLSearchParams(location.search);
  let view, traj, meta;
  try {
    [view, traj, meta] = await Promise.all([V.api(base), V.api(base + "/trajectory"), V.api("/ui/api/meta")]);
  } catch (e) { V.error(app, e); return; }
  const picker = q.get("picker") || meta.default_picker;
  const maxLen = q.get("max_seq_len") || "";
  const lines = new Map(traj.branches.map((b) => [b.id, b]));
  let selected = parseInt(q.get("branch") || String(traj.active_branch), 10);
  if (!lines.has(selected)) selected = traj.active_branch;

  app.appendChild(V.el("h2", { id: "session-title", text: "Session " + sid }));
  app.appendChild(V.el("p", { class: "kv", id: "session-facts", text:
    `state ${view.state} · home ${view.home || "-"} · ${view.turns} turns on the active line · ${view.stored_tokens} stored tokens · ` +
    `reward ${view.reward === null ? "-" : view.reward} · aborts ${view.control.aborts} · resubmits ${view.control.resubmits} · ` +
    `metadata ${V.short(view.metadata, 200)}` }));
  const live = V.el("div", { id: "live" });
  app.appendChild(live);
  const grid = V.el("div", { class: "grid" });
  app.appendChild(grid);
  const left = V.el("section", {}), right = V.el("section", {});
  grid.appendChild(left); grid.appendChild(right);

  // the samples first: the tree marks the lines the picker keeps
  let samples = null, sampleErr = null;
  const sp = new URLSearchParams({ picker: picker });
  if (maxLen) sp.set("max_seq_len", maxLen);
  try { samples = (await V.api(base + "/samples?" + sp)).samples; } catch (e) { sampleErr = e; }
  const kept = new Set(samples ? samples.map((s) => s.path[s.path.length - 1]) : []);

  left.appendChild(V.el("h2", { text: "Branches" }));
  left.appendChild(branchTree(traj, view, kept, selected, (id) => {
    const p = new URLSearchParams(q); p.set("branch", id); location.search = p.toString();
  }));
  left.appendChild(V.el("h2", { text: "Samples" }));
  left.appendChild(samplesPanel(samples, sampleErr, meta, picker, maxLen, q));
  left.appendChild(V.el("h2", { text: `Diagnostics (${view.diagnostics.length + view.diagnostics_dropped})` }));
  const diag = V.el("ul", { id: "diagnostics", class: "kv" });
  for (const d of view.diagnostics) diag.appendChild(V.el("li", { text: V.short(d, 300) }));
  left.appendChild(diag);

  const line = lines.get(selected);
  right.appendChild(V.el("h2", { id: "line-title", text: `Line: branch ${line.id} (${line.reason})` }));
  const tabs = V.el("div", { class: "tabs" });
  const tokensPane = V.el("div", { id: "tokens-pane" });
  const convPane = V.el("div", { id: "conversation-pane", hidden: true });
  const show = (which) => {
    tokensPane.hidden = which !== "tokens"; convPane.hidden = which !== "conversation";
    for (const b of tabs.children) b.classList.toggle("on", b.dataset.tab === which);
  };
  tabs.appendChild(V.el("button", { text: "Tokens", data: { tab: "tokens" }, onclick: () => show("tokens") }));
  tabs.appendChild(V.el("button", { text: "Conversation", data: { tab: "conversation" }, onclick: () => show("conversation") }));
  right.appendChild(tabs); right.appendChild(tokensPane); right.appendChild(convPane);
  show("tokens");
  const tokenView = V.renderLine(tokensPane, sid, line);
  convPane.appendChild(conversation(line, (i) => { show("tokens"); tokenView.reveal(i); }));
  followLive(live, base, sid);
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

function samplesPanel(samples, err, meta, picker, maxLen, q) {
  const box = V.el("div", { id: "samples" });
  const sel = V.el("select", { name: "picker" });
  for (const p of meta.pickers) { const o = V.el("option", { value: p, text: p }); if (p === picker) o.selected = true; sel.appendChild(o); }
  const len = V.el("input", { name: "max_seq_len", type: "number", min: 1, value: maxLen, placeholder: "none" });
  const form = V.el("form", { class: "filters", onsubmit: (ev) => {
    ev.preventDefault();
    const p = new URLSearchParams(q); p.set("picker", sel.value);
    if (len.value) p.set("max_seq_len", len.value); else p.delete("max_seq_len");
    location.search = p.toString();
  } }, V.el("label", {}, "picker ", sel), V.el("label", {}, "max_seq_len ", len), V.el("button", { type: "submit", text: "Show" }));
  box.appendChild(form);
  if (err) { V.error(box, err); return box; }
  let trained = 0;
  for (const s of samples) {
    const n = s.loss_mask.length, on = s.loss_mask.reduce((a, b) => a + b, 0);
    trained += on;
    const bar = V.el("div", { class: "maskbar", title: "trained tokens of this sample (green): each token is trained in exactly one sample" });
    let k = 0;
    while (k < n) {
      let j = k; while (j < n && s.loss_mask[j] === s.loss_mask[k]) j++;
      const seg = V.el("div", { class: s.loss_mask[k] ? "on" : "off" });
      seg.style.width = (100 * (j - k) / n) + "%";
      bar.appendChild(seg); k = j;
    }
    box.appendChild(V.el("div", { class: "sample", data: { leaf: s.path[s.path.length - 1] } },
      V.el("div", { class: "kv", text: `line ${s.path.join(" → ")} · ${n} tokens · ${on} trained · ${s.turn_boundaries.length} turns · ` +
        `status ${s.status}${s.reason ? " (" + s.reason + ")" : ""} · reward ${s.reward === null ? "-" : s.reward}` }), bar));
  }
  box.appendChild(V.el("p", { class: "muted", id: "samples-summary", text: `${samples.length} samples, ${trained} trained tokens in all` }));
  return box;
}

function conversation(line, reveal) {
  const box = V.el("div", { id: "conversation" });
  for (const t of line.turns) {
    for (const m of t.request_messages || []) box.appendChild(message(m, null));
    if (t.assistant_message) {
      box.appendChild(message(t.assistant_message, V.el("a", { href: "#", class: "to-tokens", data: { at: t.output_start },
        text: `→ its ${t.output_end - t.output_start} tokens (${t.output_start}-${t.output_end})`,
        onclick: (ev) => { ev.preventDefault(); reveal(t.output_start); } })));
    }
  }
  return box;
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

function followLive(box, base, sid) {
  const src = new EventSource(base + "/live");
  let turnBox = null, count = 0;
  const open = (branch, streams, note) => {  // the live box of a turn in flight
    count = 0;
    V.clear(box);
    turnBox = V.el("div", { class: "line livebox", id: "live-turn" });
    box.appendChild(V.el("h2", { text: `Turn in flight on branch ${branch ?? "?"}` + (streams ? ""
      : " (not streamed to its client: shown here as the engine samples; a constrained turn's at commit)") }));
    box.appendChild(V.el("p", { class: "muted", id: "live-count", text: note || "0 tokens so far" }));
    box.appendChild(turnBox);
    V.status("live: turn in flight");
  };
  const add = (ids, logprobs, texts) => {
    for (let k = 0; k < ids.length; k++) {
      turnBox.appendChild(V.el("span", { class: "tok live", title: `id ${ids[k]} · logprob ${Number(logprobs[k]).toFixed(4)}`, text: V.shown(texts[k]) }));
    }
    count += ids.length;
    document.getElementById("live-count").textContent = `${count} tokens so far`;
  };
  src.onmessage = (msg) => {
    const ev = JSON.parse(msg.data);
    if (ev.event === "hello") {
      if (!ev.busy) { V.status("live: idle"); return; }
      // opened mid-turn: the turn so far, when the server saw it
      const t = ev.turn;
      open(t ? t.branch : null, t ? t.streams : false, t && !t.known ? "opened mid-turn: the tokens so far show at commit" : null);
      if (t && t.known) add(t.ids, t.logprobs, t.texts);
    } else if (ev.event === "begin") {
      open(ev.branch, ev.streams, null);
    } else if (ev.event === "tokens" && turnBox) {
      add(ev.ids, ev.logprobs, ev.texts);
    } else if (ev.event === "unshown" && turnBox) {
      document.getElementById("live-count").textContent = `${count} tokens so far; the rest at commit (${ev.reason})`;
    } else if (ev.event === "restart" && turnBox) {
      // the engine died and the turn was re-homed: it is generated afresh
      V.clear(turnBox); count = 0;
      document.getElementById("live-count").textContent = "re-homed: 0 tokens so far";
    } else if (ev.event === "end" || ev.event === "resync") {
      V.status(ev.committed ? "live: turn committed, reloading" : "live: turn ended");
      src.close();
      setTimeout(() => location.reload(), 300);
    } else if (ev.event === "gone") { V.status("session gone"); src.close(); }
  };
}
