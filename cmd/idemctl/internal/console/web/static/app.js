// idemctl serve: refreshes the page's <main> every data-refresh seconds
// without a full reload. The fetched page is parsed inertly (DOMParser runs
// no script) and its nodes replace the current ones; the server escapes
// every value, and the CSP allows no inline script.
(function () {
  "use strict";
  var seconds = parseInt(document.body.getAttribute("data-refresh"), 10);
  if (!(seconds > 0)) {
    return;
  }
  var busy = false;
  function refresh() {
    if (busy || document.hidden) {
      return;
    }
    var active = document.activeElement;
    if (active && active.form) {
      return; // the operator is using a form
    }
    busy = true;
    fetch(window.location.href, { credentials: "same-origin", headers: { "Accept": "text/html" } })
      .then(function (resp) { return resp.text(); })
      .then(function (text) {
        var doc = new DOMParser().parseFromString(text, "text/html");
        var fresh = doc.getElementById("main");
        var main = document.getElementById("main");
        if (fresh && main) {
          main.replaceChildren.apply(main, Array.prototype.map.call(fresh.childNodes, function (n) {
            return document.importNode(n, true);
          }));
          document.body.setAttribute("data-refreshed", String(Date.now()));
        }
      })
      .catch(function () {
        document.body.setAttribute("data-refresh-failed", String(Date.now()));
      })
      .then(function () { busy = false; });
  }
  window.setInterval(refresh, seconds * 1000);
})();
