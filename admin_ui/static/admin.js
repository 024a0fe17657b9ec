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
