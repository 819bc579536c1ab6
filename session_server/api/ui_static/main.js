// Which page: the path (/ui, /ui/sessions/{sid}, /ui/control).
"use strict";

(function () {
  const app = document.getElementById("app");
  const path = location.pathname;
  let done;
  if (path.startsWith("/ui/sessions/")) done = V.sessionPage(app, decodeURIComponent(path.slice("/ui/sessions/".length)));
  else if (path === "/ui/control") done = V.controlPage(app);
  else done = V.listPage(app);
  Promise.resolve(done).then(() => { document.body.dataset.ready = "1"; }, (e) => { V.error(app, e); document.body.dataset.ready = "1"; });
})();
