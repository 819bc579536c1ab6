// The control page: pause state and weight version (GET /control/state), the engines
// with their load and health (GET /engines), and how many sessions each target is home to.
"use strict";

V.controlPage = async function (app) {
  let state, engines, sessions;
  try {
    [state, engines, sessions] = await Promise.all([V.api("/control/state"), V.api("/engines"), V.api("/ui/api/sessions?limit=1")]);
  } catch (e) { V.error(app, e); return; }
  app.appendChild(V.el("h2", { text: "Pause and weight version" }));
  app.appendChild(V.el("table", { id: "control-state" },
    ...[["paused", state.paused + (state.mode ? ` (${state.mode})` : "")], ["paused for", state.paused_for_s === null ? "-" : state.paused_for_s.toFixed(1) + " s"],
      ["weight version", state.weight_version === null ? "(unset)" : state.weight_version], ["synced", state.synced],
      ["in flight", state.in_flight], ["waiting at the gate", state.waiting_at_gate], ["LoRA pauses", JSON.stringify(state.lora_pauses)]]
      .map(([k, v]) => V.el("tr", {}, V.el("th", { text: k }), V.el("td", { text: String(v) })))));
  app.appendChild(V.el("h3", { text: "Counters" }));
  app.appendChild(V.el("p", { class: "kv", id: "control-counters", text: Object.entries(state.counters).map(([k, v]) => `${k} ${typeof v === "number" ? +v.toFixed(3) : v}`).join(" · ") }));
  app.appendChild(V.el("h2", { text: `Engines (policy ${engines.policy})` }));
  const t = V.el("table", { id: "engines" }, V.el("tr", {}, ...["engine", "protocol", "url", "dp", "healthy", "reported load"].map((h) => V.el("th", { text: h }))));
  for (const e of engines.engines) {
    t.appendChild(V.el("tr", {}, V.el("td", { text: e.id }), V.el("td", { text: e.protocol }), V.el("td", { text: e.base_url }),
      V.el("td", { text: e.dp_size }), V.el("td", { text: e.healthy ? "yes" : "NO" }), V.el("td", { class: "kv", text: V.short(e.reported_load, 200) })));
  }
  app.appendChild(t);
  app.appendChild(V.el("h2", { text: "Targets and the sessions they are home to" }));
  const tt = V.el("table", { id: "targets" }, V.el("tr", {}, ...["target", "in flight", "sessions (router)", "sessions (home here)", "resident tokens", "pending prefill"].map((h) => V.el("th", { text: h }))));
  for (const x of engines.targets) {
    tt.appendChild(V.el("tr", {}, V.el("td", { text: x.id }), V.el("td", { text: x.in_flight }), V.el("td", { text: x.sessions }),
      V.el("td", { text: sessions.homes[x.id] || 0 }), V.el("td", { text: x.resident_tokens }), V.el("td", { text: x.pending_prefill_tokens })));
  }
  app.appendChild(tt);
  app.appendChild(V.el("p", { class: "muted", text: `migrations ${engines.migrations} · re-homes ${engines.rehomes} · this page reads; it changes nothing` }));
};
