// The turn in flight, live: server-sent events from GET /sessions/{sid}/live shown in `box`
// as the engine samples them. At a turn's end the page is told (`changed`), and it reads
// what changed in place (session.js); the stream stays open for the next turn. The server
// ends a stream after a while and EventSource opens it again: a turn that ended between
// the two sent its `end` to nobody, so each `hello` (the first too: the page read the
// session before the stream opened) carries the session's committed turns, and the page
// reads again when they are not the count it last drew (`drawn`).
"use strict";

V.followLive = function (box, base, changed, drawn) {
  let src = null, turnBox = null, count = 0;
  const counter = (text) => { document.getElementById("live-count").textContent = text; };
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
    counter(`${count} tokens so far`);
  };
  const close = () => { V.clear(box); turnBox = null; };
  const onmessage = (msg) => {
    const ev = JSON.parse(msg.data);
    if (ev.event === "hello") {
      if (ev.turns_total !== drawn()) changed();
      if (!ev.busy) { close(); V.status("live: idle"); return; }
      // opened mid-turn: the turn so far, when the server saw it
      const t = ev.turn;
      open(t ? t.branch : null, t ? t.streams : false, t && !t.known ? "opened mid-turn: the tokens so far show at commit" : null);
      if (t && t.known) add(t.ids, t.logprobs, t.texts);
    } else if (ev.event === "begin") {
      open(ev.branch, ev.streams, null);
    } else if (ev.event === "tokens" && turnBox) {
      add(ev.ids, ev.logprobs, ev.texts);
    } else if (ev.event === "unshown" && turnBox) {
      counter(`${count} tokens so far; the rest at commit (${ev.reason})`);
    } else if (ev.event === "restart" && turnBox) {
      // the engine died and the turn was re-homed: it is generated afresh
      V.clear(turnBox); count = 0;
      counter("re-homed: 0 tokens so far");
    } else if (ev.event === "end") {
      close();
      V.status(ev.committed ? "live: turn committed" : "live: turn ended");
      changed();
    } else if (ev.event === "resync") {
      // this page fell behind and events were lost: the tree again, and a fresh stream's hello
      close();
      V.status("live: fell behind, reading again");
      src.close();
      connect();
      changed();
    } else if (ev.event === "gone") { V.status("session gone"); src.close(); }
  };
  const connect = () => { src = new EventSource(base + "/live"); src.onmessage = onmessage; };
  connect();
};
