// Requests to this router, with the API key as a bearer header when the server wants one.
// The key lives in this tab's sessionStorage; it never goes into a URL.
const KEY = "pdserve-api-key";
const needsKey = document.querySelector('meta[name="pdserve-auth"]').content === "required";
let asking = null;

export function keyRequired() {
  return needsKey;
}

function headers(extra) {
  const h = new Headers(extra || {});
  const key = sessionStorage.getItem(KEY);
  if (key) h.set("Authorization", "Bearer " + key);
  return h;
}

// Resolves once the user has entered a key (one dialog however many callers wait).
export function askKey(message) {
  const dialog = document.getElementById("key-dialog");
  if (asking) {
    if (!dialog.open) dialog.showModal(); // closed with Escape: the key button reopens it
    return asking;
  }
  const form = document.getElementById("key-form");
  const input = document.getElementById("key-input");
  if (message) dialog.querySelector("p").textContent = message;
  asking = new Promise((resolve) => {
    form.onsubmit = (ev) => {
      ev.preventDefault();
      if (!input.value) return;
      sessionStorage.setItem(KEY, input.value);
      input.value = "";
      dialog.close();
      asking = null;
      resolve();
    };
  });
  dialog.showModal();
  input.focus();
  return asking;
}

export async function ready() {
  if (needsKey && !sessionStorage.getItem(KEY)) await askKey();
}

// fetch() with the key; a 401 asks for the key again and retries once.
export async function api(path, init = {}) {
  await ready();
  let r = await fetch(path, { ...init, headers: headers(init.headers) });
  if (r.status === 401 && needsKey) {
    await askKey("That key was refused. Enter the server's API key.");
    r = await fetch(path, { ...init, headers: headers(init.headers) });
  }
  return r;
}

// The message of an OpenAI-style error body, else the status line.
export async function errorOf(r) {
  try {
    const body = await r.json();
    if (body && body.error && body.error.message) return `${r.status}: ${body.error.message}`;
  } catch (_) {
    // not JSON: the status says enough
  }
  return `${r.status} ${r.statusText}`;
}
