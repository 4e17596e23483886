// Starts Swagger UI on the API docs page. A file rather than an inline script, because the
// Content Security Policy forbids inline scripts; the settings come from a JSON data block.
(function () {
  "use strict";
  var body = document.querySelector("body").dataset;
  var config = JSON.parse(document.getElementById("swagger-settings").textContent);
  config.dom_id = "#swagger-ui";
  config.presets = [SwaggerUIBundle.presets.apis, SwaggerUIBundle.SwaggerUIStandalonePreset];
  if (body.csrfToken) {
    config.requestInterceptor = function (req) {
      req.headers["X-CSRFToken"] = body.csrfToken;
      return req;
    };
  }
  SwaggerUIBundle(config);
})();
