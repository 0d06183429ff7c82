// The Live view: every worker and the last requests' TTFT stages, from GET /console/state
// (one JSON the router aggregates), polled while this view is shown.
import { api, errorOf } from "./api.js";

const POLL_MS = 1000;
const STAGES = [
  ["queue", "queue"],
  ["prefill", "prefill"],
  ["transfer", "KV transfer"],
  ["first_decode", "first decode step"],
];
const $ = (id) => document.getElementById(id);
let timer = null;
let active = false;

function el(tag, cls, text) {
  const e = document.createElement(tag);
  if (cls) e.className = cls;
  if (text !== undefined) e.textContent = text;
  return e;
}

export function bytes(n) {
  const units = ["B", "KB", "MB", "GB", "TB"];
  let i = 0;
  while (n >= 1000 && i < units.length - 1) {
    n /= 1000;
    i++;
  }
  return (i ? n.toFixed(1) : String(Math.round(n))) + " " + units[i];
}

function ms(s) {
  return (s * 1000).toFixed(s < 0.01 ? 1 : 0) + " ms";
}

function stat(key, label, value) {
  const d = el("div", "stat");
  d.dataset.key = key;
  d.append(el("span", "label", label), el("span", "value", value));
  return d;
}

function meter(key, label, [used, total]) {
  const d = stat(key, label, `${used} / ${total}`);
  const bar = el("div", "meter");
  const fill = el("div", "fill");
  fill.style.width = (total ? (100 * used) / total : 0).toFixed(1) + "%";
  bar.append(fill);
  d.append(bar);
  return d;
}

function card(w) {
  const c = el("div", "card worker " + w.role);
  c.dataset.role = w.role;
  c.dataset.url = w.url;
  const head = el("div", "head");
  const ok = w.healthy && w.reachable && w.engine_alive !== false;
  head.append(el("span", "dot " + (ok ? "ok" : "bad")), el("strong", null, w.role), el("span", "muted", w.url));
  c.append(head);
  if (!w.reachable) {
    c.append(el("div", "error", "unreachable: " + (w.error || "no answer")));
    return c;
  }
  c.append(
    stat("running", "running / queued", `${w.running} / ${w.queued}`),
    stat("router_in_flight", "in flight via router", String(w.router_in_flight)),
    meter("rows", "request rows", w.rows),
    meter("kv_pages", "KV pages", w.kv_pages),
    stat("busy", "forward busy", (100 * w.busy).toFixed(0) + " %"),
    stat("transfers", "KV transfers open", String(w.transfers)),
  );
  if (w.role === "decode") {
    c.append(
      stat("kv_bytes_per_s", "KV in", bytes(w.kv_bytes_per_s) + "/s"),
      stat("kv_bytes", "KV received", bytes(w.kv_bytes)),
      stat("tokens_per_s", "tokens/s out", String(w.tokens_per_s)),
    );
  }
  c.append(stat("finished", "requests finished", String(w.finished)));
  return c;
}

function summary(s) {
  const decodes = s.workers.filter((w) => w.role === "decode" && w.reachable);
  const kv = decodes.reduce((a, w) => a + w.kv_bytes_per_s, 0);
  const r = s.router;
  const box = $("live-summary");
  box.replaceChildren(
    stat("requests_total", "requests", String(r.requests_total)),
    stat("requests_per_s", "requests/s", String(r.requests_per_s)),
    stat("failed_total", "failed", String(r.failed_total)),
    stat("aborted_total", "aborted", String(r.aborted_total)),
    stat("kv_crossing", "KV crossing", bytes(kv) + "/s"),
  );
}

function stageBar(stages, scale) {
  const bar = el("div", "stages");
  for (const [key, label] of STAGES) {
    const s = stages[key] || 0;
    const seg = el("div", "seg " + key);
    seg.style.width = (scale ? (100 * s) / scale : 0).toFixed(2) + "%";
    seg.title = `${label}: ${ms(s)}`;
    bar.append(seg);
  }
  return bar;
}

// One row a request; its bar splits its own TTFT (the TTFT column compares requests).
function recentRows(recent) {
  const ttft = (r) => STAGES.reduce((a, [k]) => a + (r.stages[k] || 0), 0);
  return recent.map((r) => {
    const tr = el("tr");
    const when = new Date(r.done_at * 1000).toLocaleTimeString();
    const parts = STAGES.map(([k, label]) => `${label} ${ms(r.stages[k] || 0)}`).join(", ");
    const cell = el("td", "wide");
    cell.append(stageBar(r.stages, ttft(r)), el("div", "muted small", parts));
    tr.append(el("td", null, when), el("td", "muted", r.worker), el("td", null, `${r.prompt_tokens} / ${r.output_tokens}`),
      el("td", null, ms(ttft(r))), cell);
    return tr;
  });
}

function render(s) {
  summary(s);
  $("workers").replaceChildren(...s.workers.map(card));
  $("recent").tBodies[0].replaceChildren(...recentRows(s.recent));
}

function legend() {
  $("legend").replaceChildren(
    ...STAGES.map(([key, label]) => {
      const item = el("span", "item");
      item.append(el("span", "swatch seg " + key), label);
      return item;
    }),
  );
}

async function poll() {
  timer = null;
  if (!active) return;
  try {
    const r = await api("/console/state");
    if (!r.ok) throw new Error(await errorOf(r));
    render(await r.json());
    $("live-error").hidden = true;
  } catch (e) {
    $("live-error").textContent = "live state unavailable: " + (e.message || e);
    $("live-error").hidden = false;
  }
  if (active && !timer) timer = setTimeout(poll, POLL_MS);
}

// Polls while the view is shown and the tab visible; stops otherwise.
export function setLive(on) {
  active = on && !document.hidden;
  if (active && !timer) poll();
  if (!active && timer) {
    clearTimeout(timer);
    timer = null;
  }
}

export function initLive(isShown) {
  legend();
  document.addEventListener("visibilitychange", () => setLive(isShown()));
}
