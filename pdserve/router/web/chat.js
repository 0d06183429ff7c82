// The Chat view: a conversation streamed from /v1/chat/completions.
import { api, errorOf } from "./api.js";
import { renderMarkdown } from "./markdown.js";

const $ = (id) => document.getElementById(id);
const history = []; // {role, content, node, stats} in conversation order
let controller = null; // the AbortController of the answer streaming now
let model = null;

export function setModel(name) {
  model = name;
}

function bubble(role) {
  const node = document.createElement("div");
  node.className = "msg " + role;
  const who = document.createElement("div");
  who.className = "who";
  who.textContent = role;
  const body = document.createElement("div");
  body.className = "body";
  const stats = document.createElement("div");
  stats.className = "stats";
  node.append(who, body, stats);
  $("messages").append(node);
  return node;
}

function addMessage(role, content) {
  const m = { role, content, node: bubble(role) };
  renderMarkdown(content, m.node.querySelector(".body"));
  history.push(m);
  return m;
}

function setBusy(busy) {
  $("send").disabled = busy;
  $("stop").disabled = !busy;
  const last = history[history.length - 1];
  $("regenerate").disabled = busy || !last || last.role !== "assistant";
}

function showError(text) {
  $("chat-error").textContent = text || "";
  $("chat-error").hidden = !text;
}

function requestBody() {
  const messages = [];
  const system = $("system").value.trim();
  if (system) messages.push({ role: "system", content: system });
  for (const m of history) if (m.content || m.role === "user") messages.push({ role: m.role, content: m.content });
  const body = {
    messages,
    stream: true,
    stream_options: { include_usage: true },
    temperature: Number($("temperature").value || 0),
    max_tokens: Math.max(1, Math.floor(Number($("max-tokens").value || 1))),
  };
  if (model) body.model = model;
  return body;
}

function ms(s) {
  return s >= 1 ? s.toFixed(2) + " s" : (s * 1000).toFixed(0) + " ms";
}

function statsText(st) {
  const parts = [];
  if (st.prompt !== undefined) parts.push(`${st.prompt} prompt + ${st.completion} tokens`);
  else parts.push(`${st.chunks} tokens`);
  if (st.ttft !== undefined) parts.push("TTFT " + ms(st.ttft));
  if (st.tpot !== undefined) parts.push("TPOT " + ms(st.tpot));
  if (st.finish) parts.push(st.finish);
  return parts.join(" · ");
}

// Reads an SSE body; calls onEvent(parsed JSON) per data line until [DONE].
async function readEvents(response, onEvent) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buf = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buf += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buf.indexOf("\n")) >= 0) {
      const line = buf.slice(0, cut).trim();
      buf = buf.slice(cut + 1);
      if (!line.startsWith("data:")) continue;
      const data = line.slice(5).trim();
      if (data === "[DONE]") return;
      onEvent(JSON.parse(data));
    }
  }
}

function onChunk(m, st, ev, redraw) {
  if (ev.error) throw new Error(ev.error.message || "the server reported an error");
  for (const c of ev.choices || []) {
    const text = (c.delta && c.delta.content) || "";
    if (text) {
      const now = performance.now();
      if (st.first === undefined) st.first = now;
      st.last = now;
      st.chunks += 1;
      m.content += text;
      redraw();
    }
    if (c.finish_reason) st.finish = c.finish_reason;
  }
  if (ev.usage) {
    st.prompt = ev.usage.prompt_tokens;
    st.completion = ev.usage.completion_tokens;
  }
}

async function answer() {
  showError("");
  const m = addMessage("assistant", "");
  m.node.classList.add("streaming");
  const st = { chunks: 0, t0: performance.now() };
  m.stats = st;
  const body = m.node.querySelector(".body");
  let pending = false;
  const redraw = () => {
    if (pending) return;
    pending = true;
    requestAnimationFrame(() => {
      pending = false;
      renderMarkdown(m.content, body);
    });
  };
  controller = new AbortController();
  setBusy(true);
  try {
    const r = await api("/v1/chat/completions", {
      method: "POST",
      headers: { "Content-Type": "application/json" },
      body: JSON.stringify(requestBody()),
      signal: controller.signal,
    });
    if (!r.ok) throw new Error(await errorOf(r));
    await readEvents(r, (ev) => onChunk(m, st, ev, redraw));
  } catch (e) {
    if (e.name === "AbortError") st.finish = "stopped";
    else {
      st.finish = "error";
      showError(String(e.message || e));
    }
  } finally {
    controller = null;
    if (st.first !== undefined) st.ttft = (st.first - st.t0) / 1000;
    const n = st.completion !== undefined ? st.completion : st.chunks;
    if (n > 1) st.tpot = (st.last - st.first) / 1000 / (n - 1);
    m.node.classList.remove("streaming");
    renderMarkdown(m.content, body);
    m.node.querySelector(".stats").textContent = statsText(st);
    m.node.dataset.state = st.finish === "stopped" || st.finish === "error" ? st.finish : "done";
    setBusy(false);
  }
}

function send() {
  const text = $("prompt").value;
  if (!text.trim() || controller) return;
  $("prompt").value = "";
  addMessage("user", text);
  answer();
}

function regenerate() {
  const last = history[history.length - 1];
  if (controller || !last || last.role !== "assistant") return;
  history.pop().node.remove();
  answer();
}

function clear() {
  if (controller) controller.abort();
  history.splice(0).forEach((m) => m.node.remove());
  showError("");
  setBusy(false);
}

export function initChat() {
  $("composer").addEventListener("submit", (ev) => {
    ev.preventDefault();
    send();
  });
  $("prompt").addEventListener("keydown", (ev) => {
    if (ev.key === "Enter" && !ev.shiftKey && !ev.isComposing) {
      ev.preventDefault();
      send();
    }
  });
  $("stop").addEventListener("click", () => controller && controller.abort());
  $("regenerate").addEventListener("click", regenerate);
  $("clear").addEventListener("click", clear);
}

// For tests and the curious: the conversation as sent to the API.
export function conversation() {
  return history.map((m) => ({ role: m.role, content: m.content, state: m.node.dataset.state || null }));
}

export function busy() {
  return controller !== null;
}
