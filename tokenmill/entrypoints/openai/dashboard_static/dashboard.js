// The tokenmill dashboard: polls /dashboard/api/state once a second and draws it. No build step.
"use strict";
const KEY = "tokenmill-api-key";
const HISTORY = 300;  // points kept for the charts (5 minutes at 1/s)
const COLORS = { used: "#3b82c4", cached: "#7cc47f", free: "#e3e6ea", queue: "#b8bec6", prefill: "#f29e38",
                 decode: "#3b82c4" };
const $ = (id) => document.getElementById(id);
const fmt = (v, digits = 0) => (v === null || v === undefined ? "–"
  : Number(v).toLocaleString("en-US", { maximumFractionDigits: digits, minimumFractionDigits: digits }));
const pct = (v) => (v === null || v === undefined ? "–" : (100 * v).toFixed(1) + " %");

const history = { t: [], gen: [], prompt: [], running: [], waiting: [], ttft50: [], ttft99: [], itl50: [], itl99: [] };
let charts = null;

function makeChart(el, series) {
  const opts = { width: el.clientWidth || 400, height: 180, legend: { live: false },
                 scales: { x: { time: true } }, axes: [{}, { size: 60 }],
                 series: [{}, ...series.map(([label, stroke, dash]) => ({ label, stroke, width: 1.5, dash }))] };
  return new uPlot(opts, [[], ...series.map(() => [])], el);
}

function initCharts() {
  charts = {
    throughput: makeChart($("chart-throughput"), [["generation", "#3b82c4"], ["prompt", "#f29e38"]]),
    requests: makeChart($("chart-requests"), [["running", "#3b82c4"], ["waiting", "#d9534f"]]),
    latency: makeChart($("chart-latency"), [["TTFT p50", "#f29e38"], ["TTFT p99", "#f29e38", [4, 4]],
                                            ["ITL p50", "#3b82c4"], ["ITL p99", "#3b82c4", [4, 4]]]),
  };
  window.addEventListener("resize", () => {
    for (const c of Object.values(charts)) c.setSize({ width: c.root.parentElement.clientWidth - 24, height: 180 });
  });
}

function push(s) {
  const lat = s.latency_ms;
  const row = { t: s.time, gen: s.throughput.generation_tokens_per_s, prompt: s.throughput.prompt_tokens_per_s,
                running: s.running, waiting: s.waiting, ttft50: lat.ttft.p50, ttft99: lat.ttft.p99,
                itl50: lat.itl.p50, itl99: lat.itl.p99 };
  for (const k in history) { history[k].push(row[k]); if (history[k].length > HISTORY) history[k].shift(); }
  charts.throughput.setData([history.t, history.gen, history.prompt]);
  charts.requests.setData([history.t, history.running, history.waiting]);
  charts.latency.setData([history.t, history.ttft50, history.ttft99, history.itl50, history.itl99]);
}

function drawBlocks(kv) {
  const canvas = $("blocks"), states = kv.states || "";
  const width = canvas.clientWidth || 800, n = states.length;
  // square cells, as large as fit: cells per row from the area each block gets
  const cell = Math.max(2, Math.floor(Math.sqrt((width * 120) / Math.max(n, 1))));
  const perRow = Math.max(1, Math.floor(width / cell));
  canvas.width = width; canvas.height = Math.max(cell, Math.ceil(n / perRow) * cell);
  const ctx = canvas.getContext("2d");
  const fill = { "0": COLORS.free, "1": COLORS.used, "2": COLORS.cached };
  for (let i = 0; i < n; i++) {
    ctx.fillStyle = fill[states[i]];
    ctx.fillRect((i % perRow) * cell, Math.floor(i / perRow) * cell, Math.max(1, cell - 1), Math.max(1, cell - 1));
  }
  $("kv-legend").innerHTML = `<i class="sw used"></i>in use ${fmt(kv.blocks_used)} <i class="sw cached"></i>cached,
    evictable ${fmt(kv.blocks_cached)} <i class="sw free"></i>free ${fmt(kv.blocks_total - kv.blocks_used
    - kv.blocks_cached)} · ${fmt(kv.blocks_total)} blocks of ${kv.block_size} tokens`;
}

function drawTimeline(requests) {
  const canvas = $("timeline"), width = canvas.clientWidth || 800, window_s = 60, pad = 40;
  const rows = requests.slice(-40), bar = Math.min(14, Math.max(3, Math.floor(200 / Math.max(rows.length, 1))));
  canvas.width = width; canvas.height = Math.max(60, rows.length * bar + 20);
  const ctx = canvas.getContext("2d"), x = (ago) => pad + (width - pad) * (1 - Math.min(ago, window_s) / window_s);
  ctx.fillStyle = "#5b6673"; ctx.font = "11px system-ui";
  for (let s = 0; s <= window_s; s += 10) ctx.fillText(s ? `-${s}s` : "now", x(s) - (s ? 12 : 24), canvas.height - 4);
  rows.forEach((r, i) => {
    const y = i * bar;
    for (const [from, to, color] of [[r.arrival_ago, r.scheduled_ago, COLORS.queue],
                                     [r.scheduled_ago, r.first_token_ago, COLORS.prefill],
                                     [r.first_token_ago, r.end_ago, COLORS.decode]]) {
      ctx.fillStyle = color;
      ctx.fillRect(x(from), y, Math.max(1, x(to) - x(from)), bar - 1);
    }
  });
}

function flatten(obj, prefix, out) {
  for (const [k, v] of Object.entries(obj)) {
    if (v && typeof v === "object" && !Array.isArray(v)) flatten(v, prefix + k + ".", out);
    else out.push([prefix + k, Array.isArray(v) ? v.join(", ") : String(v)]);
  }
  return out;
}

function render(s) {
  $("model").textContent = `${s.model} · up ${fmt(s.uptime_s / 60, 1)} min`;
  $("running").textContent = fmt(s.running);
  $("waiting").textContent = fmt(s.waiting);
  $("gen-rate").textContent = fmt(s.throughput.generation_tokens_per_s, 1);
  $("prompt-rate").textContent = fmt(s.throughput.prompt_tokens_per_s, 1);
  $("kv-usage").textContent = pct(s.kv.usage);
  $("hit-rate").textContent = pct(s.prefix_cache.hit_rate_1m);
  $("preemptions").textContent = fmt(s.preemptions_total);
  $("finished").textContent = fmt(s.totals.finished_requests);
  $("generated").textContent = fmt(s.totals.generation_tokens);
  for (const tr of document.querySelectorAll("#latency tbody tr")) {
    const m = s.latency_ms[tr.dataset.metric];
    tr.querySelector(".p50").textContent = fmt(m.p50, 1);
    tr.querySelector(".p99").textContent = fmt(m.p99, 1);
    tr.querySelector(".count").textContent = fmt(m.count);
  }
  drawBlocks(s.kv);
  drawTimeline(s.recent_requests);
  const config = flatten({ max_model_len: s.config.max_model_len, ...s.config.engine, server: s.config.server }, "", []);
  $("config").innerHTML = config.map(([k, v]) => `<tr><td>${k}</td><td></td></tr>`).join("");
  $("config").querySelectorAll("tr").forEach((tr, i) => { tr.lastChild.textContent = config[i][1]; });
  push(s);
  document.body.dataset.updates = String(Number(document.body.dataset.updates || 0) + 1);
}

async function poll() {
  const headers = {};
  const key = sessionStorage.getItem(KEY);
  if (key) headers.Authorization = "Bearer " + key;
  try {
    const r = await fetch("/dashboard/api/state", { headers, cache: "no-store" });
    if (r.status === 401) { $("auth").hidden = false; $("status").textContent = "API key needed"; return; }
    const s = await r.json();
    if (!s.ready) { $("status").textContent = "loading the model…"; return; }
    $("auth").hidden = true;
    render(s);
    $("status").textContent = "live · " + new Date(s.time * 1000).toLocaleTimeString();
  } catch (e) {
    $("status").textContent = "no connection (" + e.message + ")";
  }
}

$("auth").addEventListener("submit", (e) => { e.preventDefault(); sessionStorage.setItem(KEY, $("key").value); poll(); });
initCharts();
poll();
setInterval(poll, 1000);
