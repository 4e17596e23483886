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
  xhr.addEventListener("load", () => { window.location = xhr.responseURL || window.location.href; });
  xhr.addEventListener("error", () => form.submit());
  xhr.send(new FormData(form));
});
