// The console's entry point: tabs, the API key button, the model's name.
import { api, askKey, keyRequired, ready } from "./api.js";
import { busy, conversation, initChat, setModel } from "./chat.js";
import { renderMarkdown } from "./markdown.js";
import { initLive, setLive } from "./live.js";

const $ = (id) => document.getElementById(id);
let view = "chat";

function show(name) {
  view = name;
  for (const v of ["chat", "live"]) {
    $("view-" + v).hidden = v !== name;
    $("tab-" + v).classList.toggle("active", v === name);
  }
  setLive(name === "live");
}

async function loadModel() {
  try {
    const r = await api("/v1/models");
    if (!r.ok) return;
    const name = (await r.json()).data[0].id;
    setModel(name);
    $("model").textContent = name;
  } catch (_) {
    // no model name: requests go without one and the server picks its own
  }
}

function init() {
  initChat();
  initLive(() => view === "live");
  for (const b of document.querySelectorAll(".tab")) b.addEventListener("click", () => show(b.dataset.view));
  if (keyRequired()) {
    $("key-button").hidden = false;
    $("key-button").addEventListener("click", () => askKey());
  }
  const start = location.hash === "#live" ? "live" : "chat";
  ready().then(() => {
    loadModel();
    show(start);
  });
}

// Hooks for tests (and the browser's console): read state, render Markdown, switch views.
window.pdconsole = { conversation, busy, renderMarkdown, show };
init();
