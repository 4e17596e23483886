/* Atrium's one page script: renders every plotly figure whose JSON the server put in the
   page (json_script), again after each htmx swap. No inline script anywhere (CSP). */
(function () {
  "use strict";
  function renderCharts(root) {
    if (!window.Plotly) { return; }
    root.querySelectorAll("[data-chart]").forEach(function (el) {
      var src = document.getElementById(el.getAttribute("data-chart"));
      if (!src) { return; }
      var fig = JSON.parse(src.textContent);
      window.Plotly.react(el, fig.data || [], fig.layout || {}, {displaylogo: false, responsive: true});
    });
  }
  document.addEventListener("DOMContentLoaded", function () { renderCharts(document); });
  // Live panels poll only while the tab is visible (a filter expression in hx-trigger would
  // need eval, which the CSP forbids).
  document.addEventListener("htmx:beforeRequest", function (evt) {
    if (document.visibilityState === "hidden" && evt.detail.elt.hasAttribute("data-poll")) {
      evt.preventDefault();
    }
  });
  document.addEventListener("htmx:afterSettle", function (evt) { renderCharts(evt.target); });
})();
