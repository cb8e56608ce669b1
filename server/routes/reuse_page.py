"""The reuse page served at `/` to browsers: one HTML document, its script and style inline (no build step,
nothing fetched from elsewhere: the machine may be offline). It polls GET /debug/reuse every two seconds
and draws it; every value goes into the page as text (textContent), never as markup."""

PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>kvfork: reuse</title>
<meta name="viewport" content="width=device-width, initial-scale=1">
<style>
body{font:13px/1.4 system-ui,sans-serif;margin:16px;color:#222;background:#fafafa}
h1{font-size:18px;margin:0 0 8px}h2{font-size:14px;margin:18px 0 6px}
.stats span{display:inline-block;margin-right:18px}.stats b{font-size:16px}
table{border-collapse:collapse;background:#fff}td,th{border:1px solid #ddd;padding:2px 6px;text-align:right}
th{background:#f0f0f0}td.l,th.l{text-align:left}#status{color:#888}
ul.tree{list-style:none;padding-left:14px;margin:0}ul.tree li{margin:1px 0}.tier{color:#555}
.wrap{max-height:320px;overflow:auto;display:inline-block}
</style></head><body>
<h1>kvfork: what is reused</h1>
<div id="status">loading...</div>
<div class="stats">
<span>hit rate (tokens) <b id="hit-rate">-</b></span><span>prefill tokens saved <b id="saved">-</b></span>
<span>requests <b id="requests">-</b></span><span>cached entries <b id="entries">-</b></span>
<span>cached bytes <b id="bytes">-</b></span>
</div>
<h2>Hit rate and tokens saved over time</h2>
<svg id="chart" width="640" height="140" viewBox="0 0 640 140" role="img" aria-label="hit rate over time"></svg>
<h2>Live requests</h2>
<table id="live"><thead><tr><th class="l">request</th><th class="l">phase</th><th>prompt</th><th>committed</th>
<th>reused</th><th class="l">source</th><th class="l">clones from</th><th class="l">follows</th></tr></thead>
<tbody></tbody></table>
<h2>Cached now (a tree of shared prefixes, by scope)</h2>
<div class="wrap"><div id="tree"></div></div>
<h2>Named sessions</h2>
<table id="sessions"><thead><tr><th class="l">name</th><th class="l">scope</th><th>tokens</th><th>bytes</th>
<th>age s</th><th>uses</th></tr></thead><tbody></tbody></table>
<h2>Last placement decisions</h2>
<div class="wrap"><table id="decisions"><thead><tr><th class="l">time</th><th class="l">request</th>
<th class="l">scope</th><th>prompt</th><th>saved</th><th class="l">source</th><th class="l">reason</th>
<th class="l">donor / leader</th></tr></thead><tbody></tbody></table></div>
<script>
"use strict";
const key = new URLSearchParams(location.hash.slice(1)).get("key");
const headers = key ? {"Authorization": "Bearer " + key} : {};
const $ = (id) => document.getElementById(id);
function cell(row, text, left) {
  const td = document.createElement("td"); td.textContent = text == null ? "" : String(text);
  if (left) td.className = "l"; row.appendChild(td);
}
function fill(id, rows, columns) {
  const body = $(id).querySelector("tbody"); body.replaceChildren();
  for (const r of rows) {
    const tr = document.createElement("tr");
    for (const [get, left] of columns) cell(tr, get(r), left);
    body.appendChild(tr);
  }
}
function bytes(n) {
  const units = ["B", "KiB", "MiB", "GiB"]; let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return n.toFixed(i ? 1 : 0) + " " + units[i];
}
function node(n) {
  const li = document.createElement("li");
  const head = n.entries.map((e) => e.tier + " " + bytes(e.bytes) + ", " + Math.round(e.age_s) + " s, "
                                    + e.uses + " uses").join("; ");
  li.textContent = n.tokens + " tokens" + (head ? " \u2014 " + head : "");
  if (n.children.length) {
    const ul = document.createElement("ul"); ul.className = "tree";
    for (const c of n.children) ul.appendChild(node(c));
    li.appendChild(ul);
  }
  return li;
}
function chart(series, step) {
  const svg = $("chart"), W = 640, H = 140, pad = 24, ns = "http://www.w3.org/2000/svg";
  svg.replaceChildren();
  const now = Date.now() / 1000, span = 60 * step, x = (t) => pad + (W - 2 * pad) * (1 - (now - t) / span);
  const recent = series.filter((b) => now - b.t <= span);
  const most = Math.max(1, ...recent.map((b) => b.reused_tokens));
  const add = (tag, attrs, text) => {
    const el = document.createElementNS(ns, tag);
    for (const [k, v] of Object.entries(attrs)) el.setAttribute(k, v);
    if (text) el.textContent = text; svg.appendChild(el); return el;
  };
  add("line", {x1: pad, y1: H - pad, x2: W - pad, y2: H - pad, stroke: "#999"});
  add("text", {x: pad, y: 12, "font-size": 10, fill: "#2a7"}, "tokens saved (bars, max " + most + ")");
  add("text", {x: W - pad, y: 12, "font-size": 10, fill: "#27c", "text-anchor": "end"}, "hit rate (line, 0-100%)");
  const w = Math.max(2, (W - 2 * pad) / 60 - 1);
  let path = "";
  for (const b of recent) {
    const h = (H - 2 * pad) * b.reused_tokens / most;
    add("rect", {x: x(b.t), y: H - pad - h, width: w, height: h, fill: "#2a7", opacity: 0.6});
    const rate = b.prompt_tokens ? b.reused_tokens / b.prompt_tokens : 0;
    const cx = (x(b.t) + w / 2).toFixed(1), cy = (H - pad - (H - 2 * pad) * rate).toFixed(1);
    path += (path ? " L" : "M") + cx + " " + cy;
    add("circle", {cx, cy, r: 3, fill: "#27c"});
  }
  if (path) add("path", {d: path, fill: "none", stroke: "#27c", "stroke-width": 2});
}
function draw(d) {
  const prompt = d.series.reduce((a, b) => a + b.prompt_tokens, 0);
  const saved = d.series.reduce((a, b) => a + b.reused_tokens, 0);
  $("hit-rate").textContent = prompt ? (100 * saved / prompt).toFixed(1) + "%" : "-";
  $("saved").textContent = saved;
  $("requests").textContent = d.series.reduce((a, b) => a + b.requests, 0);
  $("entries").textContent = d.cache.entries;
  $("bytes").textContent = bytes(d.cache.bytes);
  chart(d.series, d.bucket_s);
  fill("live", d.live, [[(r) => r.request_id, 1], [(r) => r.phase, 1], [(r) => r.prompt_tokens],
       [(r) => r.committed], [(r) => r.reused_tokens], [(r) => r.source, 1], [(r) => r.donor, 1],
       [(r) => r.leader, 1]]);
  const tree = document.createElement("ul"); tree.className = "tree";
  for (const root of d.cache.tree) {
    const li = node(root); li.insertBefore(document.createTextNode("scope " + root.scope + ": "), li.firstChild);
    tree.appendChild(li);
  }
  $("tree").replaceChildren(tree);
  fill("sessions", d.sessions, [[(s) => s.name, 1], [(s) => s.scope, 1], [(s) => s.tokens], [(s) => bytes(s.bytes)],
       [(s) => Math.round(s.age_s)], [(s) => s.uses]]);
  fill("decisions", d.decisions, [[(r) => new Date(r.at * 1000).toLocaleTimeString(), 1], [(r) => r.request_id, 1],
       [(r) => r.scope, 1], [(r) => r.prompt_tokens], [(r) => r.saved_tokens], [(r) => r.source, 1],
       [(r) => r.reason, 1], [(r) => r.donor || r.leader, 1]]);
  $("status").textContent = "live: updated " + new Date(d.now * 1000).toLocaleTimeString();
}
async function poll() {
  try {
    const r = await fetch("/debug/reuse", {headers, cache: "no-store"});
    if (r.ok) draw(await r.json());
    else $("status").textContent = r.status === 401 ? "needs a key: open /#key=YOUR_KEY" : "error " + r.status;
  } catch (e) { $("status").textContent = "daemon unreachable"; }
  setTimeout(poll, 2000);
}
poll();
</script></body></html>
"""
