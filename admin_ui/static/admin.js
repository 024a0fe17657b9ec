// Refresh the page's live region in place every few seconds: the same URL is fetched
// (so the server-side sort is kept) and only <main> is swapped (so scrolling is kept).
// Everything else on the page works without this script.
(function () {
  "use strict";
  var seconds = Number(document.body.dataset.refreshSeconds || 0);
  var status = document.getElementById("refresh-status");
  if (!seconds) { return; }

  function typing() {
    // Never wipe what an operator is typing (a token field, a filter being changed); a
    // filter already applied holds the value it was rendered with, and refreshes go on.
    var inputs = document.querySelectorAll("#live input:not([type=hidden])");
    for (var i = 0; i < inputs.length; i++) {
      var input = inputs[i];
      if (input.value !== input.defaultValue || input.checked !== input.defaultChecked ||
          input === document.activeElement) {
        return true;  // a ticked row of the job browser counts too
      }
    }
    return false;
  }

  function refresh() {
    if (document.hidden || typing()) { return; }
    fetch(window.location.href, { headers: { "X-Requested-With": "refresh" } })
      .then(function (response) {
        if (!response.ok) { throw new Error("HTTP " + response.status); }
        return response.text();
      })
      .then(function (html) {
        var fresh = new DOMParser().parseFromString(html, "text/html").getElementById("live");
        var live = document.getElementById("live");
        if (fresh && live) {
          // An error an operator expanded (a host's failed reload) stays expanded.
          var open = Array.prototype.map.call(
            live.querySelectorAll("details[open][id]"), function (d) { return d.id; });
          live.innerHTML = fresh.innerHTML;
          open.forEach(function (id) {
            var again = document.getElementById(id);
            if (again) { again.open = true; }
          });
        }
        if (status) {
          status.textContent = "updated " + new Date().toLocaleTimeString();
          status.classList.remove("stale");
        }
      })
      .catch(function (error) {
        if (status) { status.textContent = "manager unreachable (" + error.message + ")"; status.classList.add("stale"); }
      });
  }

  window.setInterval(refresh, seconds * 1000);
})();

// Signed in by a one-time login (qcluster login): the session id lives in this origin's
// localStorage, never in a cookie (a browser sends a host's cookies to all of its ports), and
// goes with each form post of the page as its "session" field.
(function () {
  "use strict";
  var session = null;
  try { session = window.localStorage.getItem("qcluster_session"); } catch (e) { return; }
  if (!session) { return; }

  function signedIn() {
    var fields = document.querySelectorAll("input[name=token]");
    for (var i = 0; i < fields.length; i++) {
      fields[i].required = false;
      fields[i].placeholder = "signed in";
    }
  }

  document.addEventListener("submit", function (event) {
    var form = event.target;
    if (form.method !== "post") { return; }  // never in an address (the job search)
    var field = form.querySelector("input[name=session]");
    if (!field) {
      field = document.createElement("input");
      field.type = "hidden";
      field.name = "session";
      form.appendChild(field);
    }
    field.value = session;
  }, true);
  signedIn();
  var live = document.getElementById("live");
  if (live && window.MutationObserver) {  // the refresh above swaps the page's forms
    new MutationObserver(signedIn).observe(live, { childList: true });
  }
})();
