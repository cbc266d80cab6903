// kvactor's dashboard: reads /v1/status as a stream (a status as it changes: how often, the
// server's kvactor/server/_dashboard.py says) and draws what changed. Plain JavaScript, no
// build step, nothing fetched from elsewhere; data goes in as text, never as markup.
"use strict";

const RETRY_MS = 1000; // a lost stream is opened again after this, longer after each failure
const RETRY_MAX_MS = 2000;
const TIMELINE_EVERY_S = 5; // with no new event, the timeline's axis moves this often
const WINDOW_S = 600; // the timeline shows the last ten minutes
const MAX_EVENTS = 3000;
const COLORS = {
  hot: "var(--hot)", warm: "var(--warm)", cold: "var(--cold)", prefetched: "var(--prefetched)",
  weights: "var(--weights)", "hot caches": "var(--hot)", "ready copies": "var(--ready)",
  "working copies": "var(--working)", "activations and buffers": "var(--other)",
  "your hot caches": "var(--hot)", used: "var(--warm)",
};

const view = { instance: null, since: 0, events: [], status: null, sortKey: "last_used", up: false };

// What each part of the page last drew, as JSON: a part is drawn again only when what it
// shows changed. A redraw is style, layout and paint in every open browser, on the cores
// the engine decodes on (docs/benchmarks.md, "The dashboard's cost").
const drawn = { memory: null, agents: null, models: null, timelineAt: -Infinity, width: 0 };
function fresh(part, value) {
  const text = JSON.stringify(value);
  if (drawn[part] === text) return false;
  drawn[part] = text;
  return true;
}
function forget() {
  Object.assign(drawn, { memory: null, agents: null, models: null, timelineAt: -Infinity });
}

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
// A clock time, not "… ago": a row then changes only when its agent does.
function clock(t) { return t ? new Date(t * 1000).toLocaleTimeString([], { hour12: false }) : "–"; }

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
  listen();
});

// -- drawing ----------------------------------------------------------------------------
// Parts are changed in place (a text, a width), not built again: the browser then lays
// out and paints what changed, not the whole page.
function setText(node, text) {
  text = String(text ?? "");
  if (node.textContent !== text) node.textContent = text;
}
function setData(node, key, value) {
  if (node.dataset[key] !== value) node.dataset[key] = value;
}

// One bar per limit, with its label and legend: [{label, note, limit, parts: [{name, bytes}]}].
function drawBars(box, bars) {
  const shape = JSON.stringify(bars.map((b) => [b.label, b.parts.map((p) => p.name)]));
  if (box.dataset.shape !== shape) {
    box.replaceChildren();
    for (const b of bars) {
      const head = el("div", null, { class: "bar-label" });
      head.append(el("strong", b.label), el("span"));
      const row = el("div", null, { class: "bar" });
      const legend = el("div", null, { class: "legend" });
      for (const p of b.parts) {
        const span = el("span");
        span.style.background = COLORS[p.name] || "var(--other)";
        row.append(span);
        const item = el("span");
        const dot = el("i");
        dot.style.background = COLORS[p.name] || "var(--other)";
        item.append(dot, document.createTextNode(""));
        legend.append(item);
      }
      box.append(head, row, legend);
    }
    box.dataset.shape = shape;
  }
  bars.forEach((b, i) => {
    const [head, row, legend] = [...box.children].slice(3 * i, 3 * i + 3);
    setText(head.lastChild, b.note);
    const total = b.limit || b.parts.reduce((a, p) => a + p.bytes, 0) || 1;
    b.parts.forEach((p, j) => {
      const span = row.children[j];
      const width = (100 * p.bytes / total).toFixed(2) + "%";
      if (span.style.width !== width) span.style.width = width;
      const title = p.name + ": " + bytes(p.bytes);
      if (span.title !== title) span.title = title;
      setText(legend.children[j].lastChild, p.name + " " + bytes(p.bytes));
    });
  });
}

function drawMemory(s) {
  drawBars(document.getElementById("memory"), s.memory.map((m) => {
    let note = "of " + bytes(m.limit_bytes);
    if (m.free_bytes !== null) note = bytes(m.free_bytes) + " free " + note;
    return { label: m.kind, note, limit: m.limit_bytes, parts: m.parts };
  }));
  const disk = [];
  if (s.disk) {
    const d = s.disk;
    let note = "of " + bytes(d.limit_bytes);
    if (d.free_bytes !== null) note = bytes(d.free_bytes) + " free " + note;
    if (d.written_today_bytes !== null) note += " · written today " + bytes(d.written_today_bytes);
    disk.push({ label: "disk limit", note, limit: d.limit_bytes,
      parts: [{ name: "used", bytes: d.used_bytes }] });
  }
  drawBars(document.getElementById("disk"), disk);
  const t = s.totals;
  let line = `${t.agents} agents: ${t.hot} hot (${bytes(t.hot_bytes)}), ${t.warm} warm ` +
    `(${bytes(t.warm_bytes)} on disk), ${t.cold} cold · ${t.tokens} tokens cached`;
  if (s.counters) {
    const c = s.counters;
    line += ` · ${c.turns} turns, ${c.demoted_warm} demoted to warm, ${c.demoted_cold} to cold, ` +
      `${c.reloads} reloads · ${c.decoding} decoding, ${c.waiting} waiting`;
  }
  setText(document.getElementById("totals"), line);
}

// A table's rows by key (each row's data-NAME), kept from one draw to the next: each item's
// cells ([text, class, tier]) written where they changed, the rows put in the items' order,
// the others removed.
function drawRows(body, items, name, key, cells) {
  const had = new Map([...body.children].map((tr) => [tr.dataset[name], tr]));
  items.forEach((item, i) => {
    const k = String(key(item));
    const values = cells(item);
    let tr = had.get(k);
    if (tr === undefined) {
      tr = el("tr", null, { ["data-" + name]: k });
      for (const [, cls] of values) tr.append(el("td", null, cls ? { class: cls } : {}));
    }
    had.delete(k);
    values.forEach(([text, , tier], j) => {
      setText(tr.children[j], text);
      if (tier !== undefined) setData(tr.children[j], "tier", tier);
    });
    if (body.children[i] !== tr) body.insertBefore(tr, body.children[i] || null);
  });
  for (const tr of had.values()) tr.remove();
}

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
  drawRows(body, rows, "agent", (r) => r.id, (r) => {
    let hint = r.hint || "";
    if (r.tool_wait_s > 0) hint = (hint ? hint + " · " : "") + "tool wait " + seconds(r.tool_wait_s);
    if (r.rejected) hint = "refused: " + r.rejected;
    return [[r.id], [r.tenant || ""], [r.model], [r.tier + (r.busy ? " ·" : ""), "tier", r.tier],
      [r.tokens, "num"], [bytes(r.tier === "hot" ? r.bytes : r.warm_bytes), "num"],
      [r.last_path || "–"], [seconds(r.last_ttft_s), "num"], [rate(r.last_decode_tok_s), "num"],
      [hint], [clock(r.last_used)]];
  });
  for (const tr of body.children) setData(tr, "tier", tr.children[3].dataset.tier);
  const more = s.agents_total > s.agents.length ? ` (the ${s.agents.length} most recent)` : "";
  setText(document.getElementById("agents-count"), `${s.agents_total}${more}`);
  for (const th of document.querySelectorAll("#agents th")) {
    th.classList.toggle("sorted", th.dataset.key === k);
    th.classList.toggle("up", th.dataset.key === k && view.up);
  }
}

function drawModels(s) {
  drawRows(document.querySelector("#models tbody"), s.models, "model", (m) => m.name, (m) => [
    [m.name], [m.loaded ? (m.pinned ? "loaded, pinned" : "loaded") : "unloaded"],
    [bytes(m.weights_bytes), "num"], [m.context_length ?? "–", "num"], [m.loads ?? "–", "num"],
    [m.idle_s === undefined ? "–" : seconds(m.idle_s), "num"]]);
  setText(document.getElementById("models-line"), s.models.map((m) => m.name).join(", "));
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
  drawn.timelineAt = s.time;
  drawn.width = box.clientWidth;
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
  if (fresh("memory", [s.memory, s.disk, s.totals, s.counters])) drawMemory(s);
  if (fresh("agents", [s.agents, s.agents_total])) drawAgents(s);
  if (fresh("models", s.models)) drawModels(s);
  if (s.events.length || s.final || s.time - drawn.timelineAt >= TIMELINE_EVERY_S) drawTimeline(s);
}

// -- the stream ---------------------------------------------------------------------------
// One request every half minute or so, not one a second: the server's module doc
// (kvactor/server/_dashboard.py) says why. Each stream opens where the last one left off;
// a hidden page closes it and opens the next when it is shown again.
let failures = 0;
let timer = null;
let reading = null; // the open stream's AbortController

function stop() {
  clearTimeout(timer);
  if (reading) reading.abort();
  reading = null;
}

// A status read: drawn; false when a restarted server sent it (its events are numbered
// anew, so the page asks again from the first).
function take(s) {
  if (view.instance !== null && s.instance !== view.instance) {
    Object.assign(view, { instance: s.instance, events: [], since: 0 });
    forget();
    return false;
  }
  view.instance = s.instance;
  view.events = view.events.concat(s.events).slice(-MAX_EVENTS);
  view.since = s.events_next;
  view.status = s;
  failures = 0;
  draw(s);
  return true;
}

async function follow(response, mine) {
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += value;
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const frame = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      if (frame.startsWith("data: ") && !take(JSON.parse(frame.slice(6)))) {
        mine.abort();
        return;
      }
    }
  }
}

async function listen() {
  stop();
  if (document.hidden) return; // opened again when the page is shown
  const mine = (reading = new AbortController());
  let wait = 0; // a stream that ended: the next one at once
  try {
    const url = `/v1/status?stream=true&since=${view.since}`;
    const response = await fetch(url, { headers: headers(), cache: "no-store", signal: mine.signal });
    if (response.status === 401) {
      document.getElementById("key-form").hidden = false;
      document.getElementById("key-error").textContent = "this page needs a valid API key";
      reading = null;
      return; // the form's submit listens again
    }
    if (!response.ok) {
      const s = await response.json();
      throw new Error(s.error ? s.error.message : response.statusText);
    }
    await follow(response, mine);
  } catch (err) {
    if (reading !== mine) return; // stopped: whoever stopped it goes on
    if (!mine.signal.aborted) {
      failures++;
      const state = document.getElementById("state");
      state.dataset.state = "reconnecting";
      state.textContent = "reconnecting…";
      wait = Math.min(RETRY_MS * failures, RETRY_MAX_MS);
    }
  }
  if (reading === mine) {
    reading = null;
    timer = setTimeout(listen, wait);
  }
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
  forget();
  listen();
});
window.addEventListener("resize", () => {
  const box = document.getElementById("timeline");
  if (view.status && view.status.ready && box.clientWidth !== drawn.width) drawTimeline(view.status);
});
document.addEventListener("visibilitychange", () => {
  if (document.hidden) stop(); // a page no one sees costs nothing
  else listen(); // back in front: the present at once
});

takeKeyFromUrl();
listen();
