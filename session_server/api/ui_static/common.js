// Shared helpers of the viewer. Session text (model output, messages, metadata) is
// adversarial: it only ever reaches the page through textContent (el(), text()), never
// through innerHTML; the page's Content-Security-Policy runs no inline script either.
"use strict";

const V = {};

V.el = function (tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === undefined || v === null || v === false) continue;
    if (k === "class") node.className = v;
    else if (k === "text") node.textContent = String(v);
    else if (k === "title") node.title = String(v);
    else if (k.startsWith("on")) node.addEventListener(k.slice(2), v);
    else if (k === "data") for (const [dk, dv] of Object.entries(v)) node.dataset[dk] = String(dv);
    else node.setAttribute(k, String(v));
  }
  for (const c of children) {
    if (c === null || c === undefined || c === false) continue;
    node.appendChild(typeof c === "string" || typeof c === "number" ? document.createTextNode(String(c)) : c);
  }
  return node;
};

V.clear = function (node) {
  while (node.firstChild) node.removeChild(node.firstChild);
  return node;
};

V.api = async function (path) {
  // x-tito-viewer: the viewer reading a session is not its use (its TTL does not restart)
  const r = await fetch(path, { credentials: "same-origin", headers: { accept: "application/json", "x-tito-viewer": "1" } });
  if (!r.ok) {
    let msg = r.status + " " + r.statusText;
    try { const b = await r.json(); if (b.error) msg += ": " + b.error.message; } catch (e) { /* not JSON */ }
    throw new Error(msg);
  }
  return r.json();
};

V.error = function (where, err) {
  where.appendChild(V.el("p", { class: "err", text: String(err && err.message ? err.message : err) }));
};

V.short = function (value, n) {
  const s = typeof value === "string" ? value : JSON.stringify(value);
  return s && s.length > n ? s.slice(0, n) + "…" : (s || "");
};

V.status = function (msg) {
  document.getElementById("status").textContent = msg;
};

// a token's text as shown: whitespace made visible, newline kept
V.shown = function (text) {
  return text.replace(/\n/g, "↵\n").replace(/\t/g, "→\t");
};
