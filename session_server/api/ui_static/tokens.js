// The token view of one line: every token with its text and its kind (sampled, template,
// tool output, repair), logprob as shading with the value on hover, and markers for turn,
// output, weight-version, abort/resubmit, repair and history-rewrite positions.
// A line is cut into chunks (a turn's prompt or output, at most CHUNK tokens); a chunk's
// texts are fetched and its tokens built only when it scrolls near view, and a chunk far
// from view is emptied again (its height kept), so a 100K-token line holds a few
// thousand token elements (MAX_TOKENS beyond those near view) however far it is scrolled.
// The line is GET /sessions/{sid}/line (V.readLine): a fork's whole line (its parent's prefix
// included) at absolute positions, with the server's tool-output spans (the codec's render,
// not text matching); /trajectory holds each branch's own part only.
// When the line grows (a turn ends) the view is updated, not built again: a chunk whose
// key (V.chunkKey) did not change keeps its elements, a changed one is drawn again in place.
"use strict";

V.CHUNK = 1000;
V.MAX_TOKENS = 6000;  // token elements kept beyond those near view

V.tokenKinds = function (line) {
  // kind of each position: the arrays, the turns and the server's tool-output spans (GET .../line)
  const n = line.token_ids.length;
  const kind = new Array(n).fill("template");
  for (let i = 0; i < n; i++) if (line.loss_mask[i]) kind[i] = "sampled";
  for (const t of line.turns) {
    for (let i = t.output_start; i < t.output_end; i++) if (!line.loss_mask[i]) kind[i] = "sampled nomask";
    for (let i = t.output_end; i < t.end; i++) kind[i] = "repair";
  }
  for (const [a, b] of line.tool_spans || []) for (let i = a; i < b && i < n; i++) if (kind[i] === "template") kind[i] = "tool";
  return kind;
};

V.lineMarks = function (line) {
  // position -> [[class, label, title]]
  const marks = new Map();
  const add = (pos, cls, label, title) => {
    if (!marks.has(pos)) marks.set(pos, []);
    marks.get(pos).push([cls, label, title || label]);
  };
  for (const t of line.turns) {
    const x = t.extra || {};
    const renames = x.tool_call_id_renames;
    add(t.prompt_start, "turn", `turn ${t.index} · seq ${t.seq}`,
      `turn ${t.index} (commit order ${t.seq}): prompt tokens ${t.prompt_start}-${t.output_start}`);
    if (renames && Object.keys(renames).length) {
      add(t.prompt_start, "rename", "tool-call ids renamed",
        Object.entries(renames).map(([a, b]) => `${a} → ${b}`).join("\n"));
    }
    const spans = t.weight_spans || [];
    add(t.output_start, "output", `output · v${spans.length ? spans[0][2] : t.weight_version} · ${t.engine || ""}`,
      `sampled ${t.output_start}-${t.output_end}, finish ${t.finish_reason}`);
    const c = x.control || {};
    const aborts = c.aborts || 0;
    for (let k = 1; k < spans.length; k++) {
      add(spans[k][0], "version", `v${spans[k - 1][2]} → v${spans[k][2]}`, `weight version changes at token ${spans[k][0]}`);
      if (k <= aborts && !x.segments) add(spans[k][0], "abort", "abort · resubmit", "the engine was paused here; the partial was kept and resubmitted");
    }
    if (x.segments) {
      // each aborted segment's end, exactly: where the engine stopped and the resubmission began
      const segs = x.segments;
      for (let k = 0; k < segs.length; k++) {
        const s = segs[k], next = segs[k + 1];
        if (s.ended !== "abort") continue;
        const what = next ? "abort · resubmit" : "abort (turn ended)";
        add(t.output_start + s.end, "abort", what,
          `segment ${k} (${s.request_id} on ${s.engine}) aborted after output token ${s.end}` +
          (s.dropped ? `; its ${s.dropped} tokens were dropped (constrained) and regenerated` : "") +
          (next ? `; resubmitted as ${next.request_id}` : ""));
      }
    } else if (aborts >= spans.length && aborts > 0) {
      add(t.output_start, "abort", `${aborts} abort(s) · ${c.resubmits || 0} resubmit(s)`,
        "pauses aborted and resubmitted this turn; where is recorded only for turns committed with extra.segments");
    }
    if (t.repair_tokens) add(t.output_end, "repair", `repair ×${t.repair_tokens}`, "tokens the server added to close the turn");
    const rw = x.history_rewrite;
    if (rw && rw.first_diff !== null && rw.first_diff !== undefined) {
      add(rw.first_diff, "rewrite", "history rewrite: first differing token",
        `a re-render of turn ${rw.rewritten_turn} would differ from here; the line keeps what the model saw`);
    }
  }
  return marks;
};

V.lineChunks = function (line) {
  const out = [];
  const piece = (a, b, turn, part) => {
    for (let s = a; s < b; s += V.CHUNK) out.push({ start: s, end: Math.min(b, s + V.CHUNK), turn: turn, part: part });
  };
  let at = 0;
  for (const t of line.turns) {
    if (t.prompt_start > at) piece(at, t.prompt_start, null, "other");
    piece(t.prompt_start, t.output_start, t, "prompt");
    piece(t.output_start, t.end, t, "output");
    at = t.end;
  }
  if (line.token_ids.length > at) piece(at, line.token_ids.length, null, "other");
  return out;
};

// what a chunk's elements are drawn from: its range, its turn, its ids, kinds (tool output
// from the line's tool_spans among them: a chunk whose tool marks changed is drawn again)
// and marks; the line's last chunk never keeps its key (a character split at the end of a
// line is completed by the next token, and the line's end marks move)
const kindCodes = new Map();  // kind -> a number of its own, the same for the page's life
const kindCode = (k) => { if (!kindCodes.has(k)) kindCodes.set(k, kindCodes.size + 1); return kindCodes.get(k); };
V.chunkKey = function (line, c, kinds, marks) {
  let h = 0x811c9dc5;  // FNV-1a over ids and kinds
  const mix = (x) => { h = Math.imul(h ^ x, 16777619); };
  for (let i = c.start; i < c.end; i++) { mix(line.token_ids[i]); mix(kindCode(kinds[i])); }
  const m = [];
  for (let i = c.start; i < c.end; i++) if (marks.has(i)) m.push(i, marks.get(i));
  const last = c.end === line.token_ids.length;
  return JSON.stringify([c.start, c.end, c.part, c.turn ? c.turn.seq : null, h >>> 0, m, last ? line.token_ids.length : null]);
};

V.tokenSpan = function (i, text, kind, line, versionOf, part) {
  const lp = line.logprobs[i];
  const span = V.el("span", { class: "tok " + kind + (part === undefined ? "" : " part"), data: { i: i } });
  span.textContent = V.shown(text);
  let title = `#${i} id ${line.token_ids[i]} · ${kind} · mask ${line.loss_mask[i]}`;
  if (kind.startsWith("sampled") || kind === "repair") {
    title += ` · logprob ${lp.toFixed(4)} · p ${Math.exp(lp).toFixed(3)}`;
    const v = versionOf(i);
    if (v !== null) title += ` · weights v${v}`;
    span.style.setProperty("--a", Math.min(0.85, 0.08 + (-lp) / 6).toFixed(3));
  }
  // a token holding only some bytes of a UTF-8 character: the character shows on the token that completes it
  if (part !== undefined) title += ` · bytes of a character completed by token #${part}`;
  span.title = title;
  return span;
};

// a branch's whole line, as renderLine and its update take it
V.readLine = function (sid, branch) {
  return V.api(`/sessions/${encodeURIComponent(sid)}/line?branch=${encodeURIComponent(branch)}`);
};

V.renderLine = function (holder, sid, first) {
  // what the line gives: derive() sets them again when the line grows or another is shown
  let line, kinds, marks, versionOf, chunks, keys;
  const summary = V.el("p", { class: "legend", id: "token-summary" });
  holder.appendChild(summary);
  const derive = (next) => {
    line = next;
    kinds = V.tokenKinds(line);
    marks = V.lineMarks(line);
    const spanStarts = [];
    for (const t of line.turns) for (const s of t.weight_spans || []) spanStarts.push(s);
    versionOf = (i) => { for (const s of spanStarts) if (i >= s[0] && i < s[1]) return s[2]; return null; };
    chunks = V.lineChunks(line);
    chunks.forEach((c, k) => { c.index = k; });
    keys = chunks.map((c) => V.chunkKey(line, c, kinds, marks));
    const count = (k) => kinds.filter((x) => x === k).length;
    V.clear(summary).append(
      V.el("span", { text: `${line.token_ids.length} tokens` }),
      V.el("span", { class: "tok sampled", text: `sampled (trained) ${count("sampled")}` }),
      V.el("span", { class: "tok template", text: `template ${count("template")}` }),
      V.el("span", { class: "tok repair", text: `repair ${count("repair")}` }),
      V.el("span", { class: "tok tool", text: `tool output ${count("tool")}` }),
      V.el("span", { class: "muted", text: "darker = less likely; hover a token for its id, logprob and version" }));
  };
  derive(first);
  const box = V.el("div", { class: "line", id: "line-tokens" });
  holder.appendChild(box);
  // a click on a token shows its facts below the line (the hover title, kept after the pointer moves)
  const detail = V.el("p", { class: "kv", id: "token-detail", text: "click a token for its id, logprob and version" });
  holder.appendChild(detail);
  let picked = null;  // the clicked token's position: marked again if its chunk is drawn again
  box.addEventListener("click", (ev) => {
    const tok = ev.target.closest && ev.target.closest(".tok");
    if (!tok) return;
    for (const old of box.querySelectorAll(".tok.picked")) old.classList.remove("picked");
    tok.classList.add("picked");
    picked = parseInt(tok.dataset.i, 10);
    detail.textContent = `${tok.title} · text ${JSON.stringify(tok.textContent)}`;
  });
  const loaded = new Map();  // chunk index -> its token count, for the chunks whose elements are in the page
  const near = new Set();  // chunk indexes in or near view (the observer's margin)
  const fill = async (div, chunk) => {
    const mine = {};  // a fill the line's update overtook writes nothing
    div._fill = mine;
    let data;
    try {
      data = await V.api(`/sessions/${encodeURIComponent(sid)}/tokens?branch=${line.id}&start=${chunk.start}&end=${chunk.end}`);
    } catch (e) { if (div._fill === mine && div.isConnected) div.textContent = "(could not load: " + e.message + ")"; return; }
    // overtaken, or its chunk removed by an update meanwhile (then its index is not counted
    // as loaded: `trim` would empty a chunk that is not there)
    if (div._fill !== mine || !div.isConnected) return;
    const part = new Map((data.parts || []).map(([k, j]) => [k, j]));
    const frag = document.createDocumentFragment();
    for (let k = 0; k < data.texts.length; k++) {
      const i = chunk.start + k;
      for (const [cls, label, title] of marks.get(i) || []) frag.appendChild(V.el("span", { class: "mark " + cls, text: label, title: title, data: { at: i } }));
      const sp = V.tokenSpan(i, data.texts[k], kinds[i], line, versionOf, part.get(i));
      if (marks.has(i) && marks.get(i).some((m) => m[0] === "rewrite")) sp.classList.add("rewrite");
      if (i === picked) sp.classList.add("picked");
      frag.appendChild(sp);
    }
    if (chunk.end === line.token_ids.length) for (const [cls, label, title] of marks.get(chunk.end) || []) frag.appendChild(V.el("span", { class: "mark " + cls, text: label, title: title }));
    V.clear(div).appendChild(frag);
    div.style.minHeight = "";
    div.classList.remove("pending");
    div.dataset.loaded = "1";
    loaded.set(chunk.index, chunk.end - chunk.start);
    trim(chunk.index);
  };
  const pending = (div, c) => {
    V.clear(div).textContent = `tokens ${c.start}-${c.end} (${c.part})…`;
    div.classList.add("pending");
    delete div.dataset.loaded; delete div.dataset.loading;
    div._fill = null;
  };
  const unload = (k) => {
    const div = box.children[k];
    div.style.minHeight = div.offsetHeight + "px";  // the scroll position does not jump
    pending(div, chunks[k]);
    loaded.delete(k);
  };
  const trim = (at) => {
    // past the bound, the loaded chunks farthest from the one just filled are emptied; never one near view
    let total = 0;
    for (const n of loaded.values()) total += n;
    const far = [...loaded.keys()].filter((k) => !near.has(k)).sort((a, b) => Math.abs(b - at) - Math.abs(a - at));
    while (total > V.MAX_TOKENS && far.length) { const k = far.shift(); total -= loaded.get(k); unload(k); }
  };
  const observer = new IntersectionObserver((entries) => {
    for (const e of entries) {
      const k = parseInt(e.target.dataset.chunk, 10);
      if (!e.isIntersecting) { near.delete(k); continue; }
      near.add(k);
      if (e.target.dataset.loading) continue;
      e.target.dataset.loading = "1";
      fill(e.target, chunks[k]);
    }
  }, { root: box, rootMargin: "1500px 0px" });
  const place = (div, c, k) => {  // a chunk div, empty, sized by its token count until it is filled
    div.dataset.chunk = k; div.dataset.start = c.start; div.dataset.end = c.end;
    div.style.minHeight = Math.ceil((c.end - c.start) / 14) * 1.3 + "em";
    pending(div, c);
  };
  chunks.forEach((c, k) => {
    const div = V.el("div", { class: "chunk" });
    place(div, c, k);
    box.appendChild(div);
    observer.observe(div);
  });
  return {
    box: box,
    // scroll to token i (its chunk is loaded by the observer once it is in view)
    reveal: (i) => {
      const k = chunks.findIndex((c) => i >= c.start && i < c.end);
      if (k >= 0) box.children[k].scrollIntoView({ block: "start" });
    },
    // the line grew (or another is shown): a chunk whose key is the same keeps its elements
    // (and the box its scroll position); a changed one is drawn again in place, a new one added
    update: (next) => {
      const before = keys;
      derive(next);
      chunks.forEach((c, k) => {
        let div = box.children[k];
        if (div && before[k] === keys[k]) return;
        if (!div) {
          div = V.el("div", { class: "chunk" });
          box.appendChild(div);
          place(div, c, k);
          observer.observe(div);
        } else if (div.dataset.loaded) {
          div.dataset.start = c.start; div.dataset.end = c.end;
          fill(div, c);  // its old elements stay until the new ones are ready: nothing jumps
        } else {
          place(div, c, k);
          observer.unobserve(div); observer.observe(div);  // the observer loads it if it is near
        }
      });
      while (box.children.length > chunks.length) {
        const div = box.lastElementChild, k = parseInt(div.dataset.chunk, 10);
        observer.unobserve(div); div.remove(); div._fill = null; loaded.delete(k); near.delete(k);
      }
    },
  };
};
