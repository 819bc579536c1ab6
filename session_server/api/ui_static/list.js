// The session list: filters in the page's query string (a filtered view is a link),
// paged by the server (GET /ui/api/sessions), so 10,000 sessions cost one page of rows.
"use strict";

V.listPage = async function (app) {
  const q = new URLSearchParams(location.search);
  const field = (name, label, attrs) => V.el("label", {}, label + " ",
    V.el("input", Object.assign({ name: name, value: q.get(name) || "" }, attrs || {})));
  const select = (name, label, options) => {
    const s = V.el("select", { name: name });
    for (const [v, t] of options) {
      const o = V.el("option", { value: v, text: t });
      if ((q.get(name) || "") === v) o.selected = true;
      s.appendChild(o);
    }
    return V.el("label", {}, label + " ", s);
  };
  const form = V.el("form", { class: "filters", method: "get", action: "/ui" },
    select("state", "state", [["", "any"], ["active", "active"], ["closing", "closing"]]),
    field("instance", "instance"),
    field("meta", "metadata key[=value]", { placeholder: "task=t1" }),
    field("reward_min", "reward ≥", { type: "number", step: "any" }),
    field("reward_max", "reward ≤", { type: "number", step: "any" }),
    select("has_diagnostics", "diagnostics", [["", "any"], ["true", "has some"], ["false", "none"]]),
    select("busy", "turn in flight", [["", "any"], ["true", "yes"], ["false", "no"]]),
    V.el("button", { type: "submit", text: "Filter" }));
  app.appendChild(V.el("h2", { text: "Sessions" }));
  app.appendChild(form);
  const out = V.el("div", { id: "sessions" });
  app.appendChild(out);

  const params = new URLSearchParams();
  for (const [k, v] of q) if (v !== "") params.append(k, v);
  const offset = parseInt(q.get("offset") || "0", 10) || 0;
  const limit = parseInt(q.get("limit") || "50", 10) || 50;
  params.set("offset", offset); params.set("limit", limit);
  let data;
  try { data = await V.api("/ui/api/sessions?" + params); } catch (e) { V.error(out, e); return; }

  out.appendChild(V.el("p", { id: "counts", class: "muted",
    text: `${data.matched} of ${data.total} sessions match; showing ${data.sessions.length} from ${offset}` }));
  out.appendChild(V.el("p", { id: "instances", class: "muted", text: `instances listed: ${data.instances.join(", ")}` +
    (Object.keys(data.missing).length ? "" : " (all)") }));
  for (const [peer, why] of Object.entries(data.missing)) {
    out.appendChild(V.el("p", { class: "err missing", text: `not listed: the instance at ${peer} (${why}): its sessions are missing here` }));
  }
  const table = V.el("table", { id: "session-table" }, V.el("tr", {},
    ...["session", "state", "instance", "home", "turns", "tokens", "branches", "reward", "diagnostics", "metadata"]
      .map((h) => V.el("th", { text: h }))));
  for (const s of data.sessions) {
    table.appendChild(V.el("tr", { class: "session-row" },
      V.el("td", {}, V.el("a", { href: "/ui/sessions/" + encodeURIComponent(s.session_id), text: s.session_id })),
      V.el("td", { text: s.state + (s.busy ? " (turn in flight)" : "") }),
      V.el("td", { text: s.instance || "" }),
      V.el("td", { text: s.home || "" }),
      V.el("td", { text: s.turns }), V.el("td", { text: s.tokens }), V.el("td", { text: s.branches }),
      V.el("td", { text: s.reward === null ? "" : s.reward }),
      V.el("td", { text: s.diagnostics }),
      V.el("td", { class: "kv", text: V.short(s.metadata, 120) })));
  }
  out.appendChild(table);
  const page = (off) => { const p = new URLSearchParams(q); p.set("offset", Math.max(0, off)); return "/ui?" + p; };
  out.appendChild(V.el("div", { class: "pager" },
    offset > 0 ? V.el("a", { href: page(offset - limit), text: "← newer", id: "prev" }) : null, " ",
    offset + limit < data.matched ? V.el("a", { href: page(offset + limit), text: "older →", id: "next" }) : null));
};
