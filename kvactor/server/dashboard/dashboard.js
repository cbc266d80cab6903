// kvactor's dashboard: polls /v1/status every second and draws it. Plain JavaScript, no
// build step, nothing fetched from elsewhere; data goes in as text, never as markup.
"use strict";

const POLL_MS = 1000;
const RETRY_MAX_MS = 2000;
const WINDOW_S = 600; // the timeline shows the last ten minutes
const MAX_EVENTS = 3000;
const COLORS = {
  hot: "var(--hot)", warm: "var(--warm)", cold: "var(--cold)", prefetched: "var(--prefetched)",
  weights: "var(--weights)", "hot caches": "var(--hot)", "ready copies": "var(--ready)",
  "working copies": "var(--working)", "activations and buffers": "var(--other)",
  "your hot caches": "var(--hot)", used: "var(--warm)",
};

const view = { instance: null, since: 0, events: [], status: null, sortKey: "last_used", up: false };

// -- numbers as people read them ------------------------------------------------------
function bytes(n) {
  if (n === null || n === undefined) return "–";
  const units = ["B", "KB", "MB", "GB", "TB"];
  let i = 0;
  while (Math.abs(n) >= 1000 && i < units.length - 1) { n /= 1000; i++; }
  return (i === 0 ? n.toFixed(0) : n.toFixed(n < 10 ? 2 : 1)) + " " + units[i];
}
function seconds(s) {
  if (s === null || s === undefined) return "–";
  if (s < 1) return (s * 1000).toFixed(0) + " ms";
  if (s < 120) return s.toFixed(s < 10 ? 2 : 1) + " s";
  return (s / 60).toFixed(1) + " min";
}
function rate(r) { return r ? r.toFixed(1) + " tok/s" : "–"; }
function ago(t, now) { return t ? seconds(Math.max(now - t, 0)) + " ago" : "–"; }

function el(tag, text, attrs) {
  const node = document.createElement(tag);
  if (text !== undefined && text !== null) node.textContent = String(text);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
  return node;
}
function svg(tag, attrs, text) {
  const node = document.createElementNS("http://www.w3.org/2000/svg", tag);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
  if (text !== undefined) node.textContent = text;
  return node;
}

// -- the key ----------------------------------------------------------------------------
function takeKeyFromUrl() {
  const m = /[#&]key=([^&]+)/.exec(location.hash);
  if (m) {
    sessionStorage.setItem("kvactor-key", decodeURIComponent(m[1]));
    history.replaceState(null, "", location.pathname + location.search);
  }
}
function headers() {
  const key = sessionStorage.getItem("kvactor-key");
  return key ? { Authorization: "Bearer " + key } : {};
}
document.getElementById("key-form").addEventListener("submit", (e) => {
  e.preventDefault();
  sessionStorage.setItem("kvactor-key", document.getElementById("key-input").value.trim());
  document.getElementById("key-form").hidden = true;
  poll();
});

// -- drawing ----------------------------------------------------------------------------
function bar(parent, label, parts, limit, note) {
  const head = el("div", null, { class: "bar-label" });
  head.append(el("strong", label), el("span", note));
  const row = el("div", null, { class: "bar" });
  const legend = el("div", null, { class: "legend" });
  const total = limit || parts.reduce((a, p) => a + p.bytes, 0) || 1;
  for (const p of parts) {
    const span = el("span", null, { title: p.name + ": " + bytes(p.bytes) });
    span.style.width = (100 * p.bytes / total).toFixed(2) + "%";
    span.style.background = COLORS[p.name] || "var(--other)";
    row.append(span);
    const item = el("span");
    const dot = el("i");
    dot.style.background = COLORS[p.name] || "var(--other)";
    item.append(dot, p.name + " " + bytes(p.bytes));
    legend.append(item);
  }
  parent.append(head, row, legend);
}

function drawMemory(s) {
  const box = document.getElementById("memory");
  box.replaceChildren();
  for (const m of s.memory) {
    let note = "of " + bytes(m.limit_bytes);
    if (m.free_bytes !== null) note = bytes(m.free_bytes) + " free " + note;
    bar(box, m.kind, m.parts, m.limit_bytes, note);
  }
  const disk = document.getElementById("disk");
  disk.replaceChildren();
  if (s.disk) {
    const d = s.disk;
    let dnote = "of " + bytes(d.limit_bytes);
    if (d.written_today_bytes !== null) dnote += " · written today " + bytes(d.written_today_bytes);
    bar(disk, "disk limit", [{ name: "used", bytes: d.used_bytes }], d.limit_bytes, dnote);
  }
  const t = s.totals;
  let line = `${t.agents} agents: ${t.hot} hot (${bytes(t.hot_bytes)}), ${t.warm} warm ` +
    `(${bytes(t.warm_bytes)} on disk), ${t.cold} cold · ${t.tokens} tokens cached`;
  if (s.counters) {
    const c = s.counters;
    line += ` · ${c.turns} turns, ${c.demoted_warm} demoted to warm, ${c.demoted_cold} to cold, ` +
      `${c.reloads} reloads · ${c.decoding} decoding, ${c.waiting} waiting`;
  }
  document.getElementById("totals").textContent = line;
}

function cell(text, cls) { return el("td", text, cls ? { class: cls } : {}); }

function drawAgents(s) {
  const filter = document.getElementById("filter").value.trim().toLowerCase();
  let rows = s.agents;
  if (filter) {
    rows = rows.filter((r) => [r.id, r.tier, r.model, r.tenant || "", r.last_path || ""]
      .some((v) => String(v).toLowerCase().includes(filter)));
  }
  const k = view.sortKey, sign = view.up ? 1 : -1;
  rows = rows.slice().sort((a, b) => {
    const x = a[k] ?? "", y = b[k] ?? "";
    return (x < y ? -1 : x > y ? 1 : 0) * sign || (a.id < b.id ? -1 : 1);
  });
  const body = document.querySelector("#agents tbody");
  const out = [];
  for (const r of rows) {
    const tr = el("tr", null, { "data-agent": r.id, "data-tier": r.tier });
    const tier = cell(r.tier + (r.busy ? " ·" : ""), "tier");
    tier.dataset.tier = r.tier;
    const stored = r.tier === "hot" ? r.bytes : r.warm_bytes;
    let hint = r.hint || "";
    if (r.tool_wait_s > 0) hint = (hint ? hint + " · " : "") + "tool wait " + seconds(r.tool_wait_s);
    if (r.rejected) hint = "refused: " + r.rejected;
    tr.append(cell(r.id), cell(r.tenant || ""), cell(r.model), tier,
      cell(r.tokens, "num"), cell(bytes(stored), "num"), cell(r.last_path || "–"),
      cell(seconds(r.last_ttft_s), "num"), cell(rate(r.last_decode_tok_s), "num"),
      cell(hint), cell(ago(r.last_used, s.time)));
    out.push(tr);
  }
  body.replaceChildren(...out);
  const more = s.agents_total > s.agents.length ? ` (the ${s.agents.length} most recent)` : "";
  document.getElementById("agents-count").textContent = `${s.agents_total}${more}`;
  for (const th of document.querySelectorAll("#agents th")) {
    th.classList.toggle("sorted", th.dataset.key === k);
    th.classList.toggle("up", th.dataset.key === k && view.up);
  }
}

function drawModels(s) {
  const out = s.models.map((m) => {
    const tr = el("tr");
    tr.append(cell(m.name), cell(m.loaded ? (m.pinned ? "loaded, pinned" : "loaded") : "unloaded"),
      cell(bytes(m.weights_bytes), "num"), cell(m.context_length ?? "–", "num"),
      cell(m.loads ?? "–", "num"), cell(m.idle_s === undefined ? "–" : seconds(m.idle_s), "num"));
    return tr;
  });
  document.querySelector("#models tbody").replaceChildren(...out);
  document.getElementById("models-line").textContent = s.models.map((m) => m.name).join(", ");
}

function drawLegend() {
  const box = document.getElementById("legend");
  if (box.childElementCount) return;
  const items = [["hot", "TTFT: hot"], ["prefetched", "prefetched"], ["warm", "warm (reload)"],
    ["cold", "cold"], ["reprefill", "re-prefill"], ["demoted", "demotion (below the axis)"],
    ["reloaded", "reload (above it)"], ["rate", "decode tok/s"]];
  for (const [key, label] of items) {
    const item = el("span");
    const dot = el("i");
    dot.style.background = key === "rate" ? "#2b8a3e" : `var(--${key})`;
    item.append(dot, label);
    box.append(item);
  }
}

function drawTimeline(s) {
  drawLegend();
  const box = document.getElementById("timeline");
  const W = box.clientWidth || 800, H = 220, L = 44, R = 44, T = 8, B = 30;
  box.setAttribute("viewBox", `0 0 ${W} ${H}`);
  const events = view.events;
  const end = s.final && events.length ? events[events.length - 1].t + 1 : s.time;
  // The last ten minutes, or since the first event when that is sooner (a short run).
  const first = events.length ? events[0].t - 1 : end - WINDOW_S;
  const start = Math.min(Math.max(end - WINDOW_S, first), end - 10);
  const turns = events.filter((e) => e.kind === "turn" && e.t >= start);
  const x = (t) => L + (W - L - R) * (t - start) / Math.max(end - start, 1);
  const maxTtft = Math.max(0.1, ...turns.map((e) => e.ttft_s));
  const lo = Math.log10(0.001), hi = Math.log10(maxTtft * 1.2);
  const y = (v) => T + (H - T - B) * (1 - (Math.log10(Math.max(v, 0.001)) - lo) / (hi - lo));
  const maxRate = Math.max(1, ...turns.map((e) => e.decode_tok_s || 0));
  const yr = (v) => T + (H - T - B) * (1 - v / (maxRate * 1.1));
  const nodes = [svg("line", { x1: L, y1: H - B, x2: W - R, y2: H - B, stroke: "#ced4da" })];
  for (const v of [0.001, 0.01, 0.1, 1, 10, 100]) {
    if (v > maxTtft * 1.2) break;
    nodes.push(svg("text", { x: 2, y: y(v) + 3 }, seconds(v)));
    nodes.push(svg("line", { x1: L, y1: y(v), x2: W - R, y2: y(v), stroke: "#f1f3f5" }));
  }
  nodes.push(svg("text", { x: W - R + 4, y: T + 8 }, rate(maxRate)));
  nodes.push(svg("text", { x: L, y: H - 4 }, end - start < WINDOW_S ? "since the first turn" : "last 10 min"));
  const points = turns.filter((e) => e.decode_tok_s > 0)
    .map((e) => `${x(e.t).toFixed(1)},${yr(e.decode_tok_s).toFixed(1)}`);
  if (points.length > 1) {
    nodes.push(svg("polyline", { points: points.join(" "), fill: "none", stroke: "#2b8a3e",
      "stroke-width": 1, opacity: 0.6 }));
  }
  for (const e of events) {
    if (e.t < start) continue;
    if (e.kind === "demoted" || e.kind === "reloaded") {
      // Every move of the tiers: demotions tick below the axis (out of the warm tier:
      // longer), reloads above it.
      const down = e.kind === "demoted";
      const reach = down ? (e.from === "warm" ? 14 : 8) : -8;
      const mark = svg("line", { x1: x(e.t), x2: x(e.t), y1: H - B, y2: H - B + reach,
        stroke: `var(--${e.kind})`, "stroke-width": 2, class: e.kind });
      mark.append(svg("title", {}, `${e.agent}: ${down ? `demoted from ${e.from || "hot"} to ${e.to}` :
        `reloaded (${e.source})`}, ${bytes(e.bytes)}`));
      nodes.push(mark);
    } else if (e.kind === "turn") {
      const c = svg("circle", { cx: x(e.t), cy: y(e.ttft_s), r: 3.5, fill: COLORS[e.path] || "#000",
        stroke: e.reprefill ? "var(--reprefill)" : "none", "stroke-width": 2 });
      c.append(svg("title", {}, `${e.agent}: ${e.path}${e.reprefill ? " (re-prefill)" : ""}, ` +
        `TTFT ${seconds(e.ttft_s)}, ${rate(e.decode_tok_s)}`));
      nodes.push(c);
    }
  }
  box.replaceChildren(...nodes);
}

function draw(s) {
  const state = document.getElementById("state");
  state.dataset.state = s.final ? "final" : "live";
  state.textContent = s.final ? "run over: final state" : "live";
  if (!s.ready) return;
  drawMemory(s);
  drawAgents(s);
  drawModels(s);
  drawTimeline(s);
}

// -- polling ------------------------------------------------------------------------------
let failures = 0;
let timer = null;

async function poll() {
  clearTimeout(timer);
  let wait = POLL_MS;
  try {
    const url = `/v1/status?since=${view.since}`;
    const response = await fetch(url, { headers: headers(), cache: "no-store" });
    if (response.status === 401) {
      document.getElementById("key-form").hidden = false;
      document.getElementById("key-error").textContent = "this page needs a valid API key";
      return; // the form's submit polls again
    }
    const s = await response.json();
    if (!response.ok) throw new Error(s.error ? s.error.message : response.statusText);
    if (view.instance !== null && s.instance !== view.instance) {
      // A restarted server: its events are numbered anew, so ask again from the first.
      view.instance = s.instance; view.events = []; view.since = 0;
      timer = setTimeout(poll, 0);
      return;
    }
    view.instance = s.instance;
    view.events = view.events.concat(s.events).slice(-MAX_EVENTS);
    view.since = s.events_next;
    view.status = s;
    failures = 0;
    draw(s);
    if (s.final) wait = 5 * POLL_MS;
  } catch (err) {
    failures++;
    const state = document.getElementById("state");
    state.dataset.state = "reconnecting";
    state.textContent = "reconnecting…";
    wait = Math.min(POLL_MS * failures, RETRY_MAX_MS);
  }
  timer = setTimeout(poll, wait);
}

for (const th of document.querySelectorAll("#agents th")) {
  th.addEventListener("click", () => {
    if (view.sortKey === th.dataset.key) view.up = !view.up;
    else { view.sortKey = th.dataset.key; view.up = th.dataset.key === "id"; }
    if (view.status && view.status.ready) drawAgents(view.status);
  });
}
document.getElementById("filter").addEventListener("input", () => {
  if (view.status && view.status.ready) drawAgents(view.status);
});

window.addEventListener("hashchange", () => {
  // Another key given in the address: start over with what it may see.
  takeKeyFromUrl();
  Object.assign(view, { instance: null, since: 0, events: [], status: null });
  poll();
});

takeKeyFromUrl();
poll();
