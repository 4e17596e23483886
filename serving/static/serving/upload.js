// Upload with progress for forms marked data-upload-progress (no inline script: CSP).
document.addEventListener("submit", (event) => {
  const form = event.target;
  if (!form.matches("form[data-upload-progress]") || !window.XMLHttpRequest) return;
  event.preventDefault();
  const bar = form.querySelector("progress");
  const xhr = new XMLHttpRequest();
  xhr.open("POST", form.action);
  xhr.upload.addEventListener("progress", (e) => {
    if (e.lengthComputable && bar) { bar.hidden = false; bar.value = Math.round((e.loaded / e.total) * 100); }
  });
  xhr.addEventListener("load", () => {
    if (xhr.status < 400) { window.location = xhr.responseURL || window.location.href; return; }
    // A refusal answers the page again with the reason on the file field: show that form.
    const page = new DOMParser().parseFromString(xhr.responseText, "text/html");
    const fresh = page.querySelector("form[data-upload-progress]");
    if (fresh) form.replaceWith(document.importNode(fresh, true));
    else document.body.replaceWith(document.importNode(page.body, true));
  });
  xhr.addEventListener("error", () => form.submit());
  xhr.send(new FormData(form));
});
