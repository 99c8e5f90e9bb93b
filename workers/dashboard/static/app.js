// areal-async dashboard: one snapshot at load, then server-sent updates (workers/dashboard/app.py).
"use strict";

const state = { data: null, cursor: null, source: null, xaxis: "step" };
const ROLLOUTS_KEPT = 200, LETTERS_KEPT = 500;
const COLORS = ["#0366d6", "#d73a49", "#28a745", "#6f42c1", "#e36209", "#005cc5", "#959da5"];

const $ = (sel) => document.querySelector(sel);
const esc = (s) => String(s ?? "").replace(/[&<>"']/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" })[c]);
const fmt = (x, d = 3) => (x === null || x === undefined || Number.isNaN(x) ? "–" : Number(x).toFixed(d));

function bytes(n) {
  if (!n) return "–";
  const u = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < u.length - 1) { n /= 1024; i++; }
  return `${n.toFixed(i ? 1 : 0)} ${u[i]}`;
}

function ago(s) {
  if (s < 60) return `${s.toFixed(1)} s ago`;
  if (s < 3600) return `${(s / 60).toFixed(1)} min ago`;
  return `${(s / 3600).toFixed(1)} h ago`;
}

// ---- pages -----------------------------------------------------------------------------------

function showPage() {
  const page = (location.hash || "#fleet").slice(1);
  document.querySelectorAll(".page").forEach((el) => el.classList.toggle("active", el.id === `page-${page}`));
  document.querySelectorAll("nav a").forEach((a) => a.classList.toggle("active", a.dataset.page === page));
  if (page === "steps") renderSteps();
}
window.addEventListener("hashchange", showPage);

function renderHeader() {
  const d = state.data;
  $("#run").textContent = d.run;
  const parts = [
    d.source === "store" ? "finished run (read from its store)" : "live",
    `trained v${Math.max(d.published_version, 0)}`,
    `served v${Math.max(d.served_version, 0)}`,
  ];
  if (d.total_steps) parts.push(`of ${d.total_steps} steps`);
  if (d.ended) parts.push(`ended: ${d.ended.reason}`);
  $("#status").textContent = parts.join(" · ");
}

function renderFleet() {
  const rows = state.data.fleet.map((w) => `
    <tr class="state-${esc(w.state)}" data-role="${esc(w.role)}" data-state="${esc(w.state)}" data-pid="${w.pid}" data-worker="${esc(w.worker_id)}">
      <td>${esc(w.role)}</td><td>${esc(w.worker_id)}</td><td>${esc(w.host)}</td><td class="num">${w.pid}</td>
      <td class="state">${esc(w.state)}</td><td>${esc(w.status)}</td>
      <td class="num">${w.policy_version >= 0 ? "v" + w.policy_version : "–"}</td>
      <td class="num">${ago(w.last_beat_s)}</td><td class="num">${bytes(w.peak_rss)}</td>
      <td class="num">${w.restarts}</td><td class="num">${w.handled}</td>
      <td>${esc(w.stall || w.detail || w.phase)}</td>
    </tr>`);
  $("#fleet-table tbody").innerHTML = rows.join("");
  const roles = new Set(state.data.fleet.filter((w) => w.state !== "dead" && w.state !== "exited").map((w) => w.role));
  $("#fleet-note").textContent = state.data.fleet.length
    ? `${roles.size} role(s) with a live worker: ${[...roles].sort().join(", ")}. "dead": silent past the heartbeat TTL while the run goes on; a replacement is a new row.`
    : "no worker has been heard from (a finished run keeps none once their heartbeats expire)";
}

// ---- charts ----------------------------------------------------------------------------------

function drawChart(canvas, series, { yMin = null, hline = null } = {}) {
  const dpr = window.devicePixelRatio || 1;
  const w = canvas.clientWidth || 520, h = canvas.clientHeight || 240;
  canvas.width = w * dpr; canvas.height = h * dpr;
  const g = canvas.getContext("2d");
  g.scale(dpr, dpr);
  g.clearRect(0, 0, w, h);
  const pad = { l: 48, r: 24, t: 22, b: 24 };
  const pts = series.flatMap((s) => s.xs.map((x, i) => [x, s.ys[i]]).filter(([x, y]) => x !== null && y !== null));
  canvas.dataset.points = series.reduce((m, s) => Math.max(m, s.ys.filter((y) => y !== null).length), 0);
  g.font = "11px system-ui, sans-serif";
  if (!pts.length) { g.fillStyle = "#6a737d"; g.fillText("no data yet", pad.l, h / 2); return; }
  let [x0, x1, y0, y1] = [Infinity, -Infinity, Infinity, -Infinity];  // loops: a long run outgrows spread arguments
  for (const [x, y] of pts) { x0 = Math.min(x0, x); x1 = Math.max(x1, x); y0 = Math.min(y0, y); y1 = Math.max(y1, y); }
  if (hline !== null) { y0 = Math.min(y0, hline); y1 = Math.max(y1, hline); }
  if (yMin !== null) y0 = Math.min(y0, yMin);
  if (x1 === x0) x1 = x0 + 1;
  if (y1 === y0) y1 = y0 + 1;
  y1 += (y1 - y0) * 0.05;
  const X = (x) => pad.l + ((x - x0) / (x1 - x0)) * (w - pad.l - pad.r);
  const Y = (y) => h - pad.b - ((y - y0) / (y1 - y0)) * (h - pad.t - pad.b);
  g.strokeStyle = "#d8dee4"; g.fillStyle = "#6a737d"; g.lineWidth = 1;
  for (let i = 0; i <= 4; i++) {
    const y = y0 + ((y1 - y0) * i) / 4;
    g.beginPath(); g.moveTo(pad.l, Y(y)); g.lineTo(w - pad.r, Y(y)); g.stroke();
    g.fillText(Math.abs(y) >= 1000 ? y.toFixed(0) : y.toPrecision(3), 2, Y(y) + 4);
  }
  for (let i = 0; i <= 5; i++) {
    const x = x0 + ((x1 - x0) * i) / 5;
    g.fillText(x.toFixed(x1 - x0 > 10 ? 0 : 1), X(x) - 8, h - 6);
  }
  if (hline !== null) {
    g.strokeStyle = "#d73a49"; g.setLineDash([5, 4]);
    g.beginPath(); g.moveTo(pad.l, Y(hline)); g.lineTo(w - pad.r, Y(hline)); g.stroke(); g.setLineDash([]);
  }
  let lx = pad.l;
  series.forEach((s, k) => {
    const color = s.color || COLORS[k % COLORS.length];
    g.strokeStyle = color; g.fillStyle = color; g.lineWidth = 1.5;
    g.beginPath();
    let started = false;
    s.xs.forEach((x, i) => {
      const y = s.ys[i];
      if (x === null || y === null) { started = false; return; }
      if (!started) { g.moveTo(X(x), Y(y)); started = true; } else g.lineTo(X(x), Y(y));
    });
    g.stroke();
    if (s.dots) s.xs.forEach((x, i) => { if (s.ys[i] !== null) { g.beginPath(); g.arc(X(x), Y(s.ys[i]), 2.5, 0, 7); g.fill(); } });
    g.fillText(s.name, lx, 12);
    lx += g.measureText(s.name).width + 16;
  });
}

function renderSteps() {
  const d = state.data;
  if (!d || !$("#page-steps").classList.contains("active")) return;
  const st = d.steps, n = st.step.length;
  $("#steps-count").textContent = `${n} step${n === 1 ? "" : "s"}`;
  const t0 = st.time.reduce((m, t) => (t === null ? m : Math.min(m, t)), Infinity);
  const byTime = state.xaxis === "time";
  const xs = byTime ? st.time.map((t) => (t === null ? null : t - t0)) : st.step;
  const timeOf = new Map(st.step.map((s, i) => [s, st.time[i]]));
  const atVersion = (pairs) => ({
    xs: pairs.map(([v]) => (byTime ? (timeOf.has(v) ? timeOf.get(v) - t0 : null) : v)),
    ys: pairs.map(([, y]) => y),
  });
  const evals = atVersion(d.evals), hand = atVersion(d.handoffs);
  drawChart($("#chart-reward"), [
    { name: "reward mean", xs, ys: st.reward_mean },
    { name: "held-out accuracy", xs: evals.xs, ys: evals.ys, dots: true },
  ], { yMin: 0 });
  drawChart($("#chart-staleness"), [
    { name: "mean", xs, ys: st.staleness_mean },
    { name: "max", xs, ys: st.staleness_max },
    { name: `bound (max_staleness ${d.max_staleness ?? "?"})`, xs: [], ys: [], color: "#d73a49" },
  ], { yMin: 0, hline: d.max_staleness });
  drawChart($("#chart-phases"), [
    { name: "wait", xs, ys: st.wait_s },
    { name: "pi_prox", xs, ys: st.prox_seconds },
    { name: "compute", xs, ys: st.compute_s },
    { name: "save", xs, ys: st.save_s },
    { name: "hand-off", xs: hand.xs, ys: hand.ys, dots: true },
  ], { yMin: 0 });
  drawChart($("#chart-tokens"), [{ name: "trained tokens/s", xs, ys: st.trained_tokens_per_s }], { yMin: 0 });
  if (window.__firstStepsRender === undefined && n) window.__firstStepsRender = performance.now();
}
$("#xaxis").addEventListener("change", (e) => { state.xaxis = e.target.value; renderSteps(); });
window.addEventListener("resize", () => renderSteps());

// ---- rollouts --------------------------------------------------------------------------------

function toolMarked(text) {
  return esc(text).replace(/(&lt;tool_call&gt;[\s\S]*?(&lt;\/tool_call&gt;|$))/g, '<span class="tool">$1</span>');
}

function num(id) { const v = $(id).value; return v === "" ? null : Number(v); }

function renderRollouts() {
  const [rmin, rmax, vmin, vmax, kind] = [num("#f-rmin"), num("#f-rmax"), num("#f-vmin"), num("#f-vmax"), $("#f-kind").value];
  const keep = (c) => (rmin === null || (c.reward ?? 0) >= rmin) && (rmax === null || (c.reward ?? 0) <= rmax)
    && (vmin === null || (c.tail ?? -1) >= vmin) && (vmax === null || (c.head ?? 1e9) <= vmax);
  const out = [];
  let shown = 0;
  for (const g of [...state.data.rollouts].reverse()) {
    if (kind && g.kind !== kind) continue;
    const cs = g.completions.filter(keep);
    if (!cs.length) continue;
    shown++;
    const rows = cs.map((c) => {
      const span = c.head === null ? "–" : c.head === c.tail ? `v${c.head}` : `v${c.head}..v${c.tail}`;
      const episode = c.turns.length > 1;
      const transcript = episode && c.turns.every(([, , text]) => text !== null);
      const turns = episode
        ? `<div class="turns">${c.turns.length} turns: ${c.turns.map(([k, t]) => `<span class="turn-${k}">${k} ${t}</span>`).join(" · ")}</div>` : "";
      const body = transcript
        ? c.turns.map(([k, , text]) => `<pre class="turn turn-${k}">${toolMarked(text)}</pre>`).join("")
        : `<pre>${toolMarked(c.text)}</pre>`;
      return `<div class="completion" data-reward="${c.reward}">
        <span class="${c.reward > 0 ? "reward-pos" : "reward-zero"}">r ${fmt(c.reward, 2)}</span>
        <span>${c.tokens} tok</span>
        <span class="${c.head !== c.tail ? "span-mixed" : ""}" title="versions of its first and last token">${span}</span>
        <div>${body}${turns}${c.error ? `<div class="note">reward error: ${esc(c.error)}</div>` : ""}</div>
      </div>`;
    });
    out.push(`<div class="group" data-task="${esc(g.task_id)}">
      <div class="ghead"><b>${esc(g.task_id)}</b><span>${esc(g.kind)}</span><span>v${g.head}..v${g.tail}</span>
        <span>${esc(g.engine)}</span><span>${new Date(g.at * 1000).toLocaleTimeString()}</span>
        ${g.answer ? `<span>answer: ${esc(g.answer)}</span>` : ""}</div>
      <div class="prompt"><pre>${esc(g.prompt)}</pre></div>${rows.join("")}</div>`);
    if (shown >= 50) break;
  }
  $("#rollout-list").innerHTML = out.join("") || '<p class="note">no scored group yet (a finished run keeps only the groups not yet checkpointed)</p>';
  $("#rollouts-count").textContent = `${shown} of ${state.data.rollouts.length} groups shown (newest first)`;
}
["#f-rmin", "#f-rmax", "#f-vmin", "#f-vmax", "#f-kind"].forEach((id) => $(id).addEventListener("input", renderRollouts));

function renderLetters() {
  const rows = [...state.data.letters].reverse().map((l) => `
    <tr data-kind="${esc(l.kind)}"><td>${l.at ? new Date(l.at * 1000).toLocaleString() : "–"}</td><td>${esc(l.kind)}</td>
    <td>${esc(l.subject)}</td><td>${esc(l.reason)}</td><td>${esc(l.worker)}</td><td>${esc(l.detail)}</td></tr>`);
  $("#letters-table tbody").innerHTML = rows.join("");
  $("#letters-note").textContent = rows.length ? "" : "no dead letter, refusal or stall so far";
}

function renderAll() {
  renderHeader(); renderFleet(); renderSteps(); renderRollouts(); renderLetters();
}

// ---- data ------------------------------------------------------------------------------------

function merge(u) {
  const d = state.data;
  Object.assign(d, { fleet: u.fleet, evals: u.evals, handoffs: u.handoffs, ended: u.ended, now: u.now,
    published_version: u.published_version, served_version: u.served_version });
  const stepsChanged = u.steps.step.length > 0 || u.steps_from < d.steps.step.length;
  for (const k of Object.keys(u.steps)) d.steps[k] = (d.steps[k] || []).slice(0, u.steps_from).concat(u.steps[k]);
  d.rollouts = d.rollouts.concat(u.rollouts).slice(-ROLLOUTS_KEPT);
  d.letters = d.letters.concat(u.letters).slice(-LETTERS_KEPT);
  state.cursor = u.cursor;
  renderHeader(); renderFleet();
  if (stepsChanged || u.evals.length || u.handoffs.length) renderSteps();
  if (u.rollouts.length) renderRollouts();
  if (u.letters.length) renderLetters();
}

function retry(why) {
  $("#status").textContent = `${why}; retrying…`;
  setTimeout(start, 3000);
}

async function start() {
  if (state.source) { state.source.close(); state.source = null; }
  let r;
  try {
    r = await fetch("api/snapshot", { credentials: "same-origin" });
  } catch (e) {
    retry("the dashboard is unreachable");
    return;
  }
  if (!r.ok) { $("#status").textContent = `error ${r.status}: ${await r.text()}`; return; }
  state.data = await r.json();
  state.cursor = state.data.cursor;
  renderAll();
  const q = new URLSearchParams(Object.entries(state.cursor).map(([k, v]) => [k, String(v)]));
  const src = new EventSource(`api/events?${q}`);
  src.addEventListener("update", (e) => merge(JSON.parse(e.data)));
  src.onerror = () => { src.close(); retry("the update stream broke"); };
  state.source = src;
}

if (new URLSearchParams(location.search).has("token")) history.replaceState(null, "", location.pathname + location.hash);
showPage();
start();
