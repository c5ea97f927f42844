// TIDE live status page: polls /v1/status and /v1/status/history, renders every part, draws SVG charts.
// Every number shown is a <span data-k="<path in the JSON>" data-f="<format>">: the path names the value in
// the /v1/status document (or, for "history.<field>", in the last /v1/status/history sample), so a test can
// read what is shown and compare it with the JSON.
"use strict";

const STATUS_EVERY_MS = 3000;
const HISTORY_EVERY_MS = 5000;
const state = { doc: null, history: [], interval: 5, lastSample: null };
window.tideStatus = null; // the last document rendered (tests read it)

const $ = (id) => document.getElementById(id);
const esc = (s) => String(s ?? "").replace(/[&<>"']/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" }[c]));

function fmt(x, f) {
  if (x === null || x === undefined || (typeof x === "number" && !isFinite(x))) return "—";
  switch (f) {
    case "int": return String(Math.round(x));
    case "f1": return Number(x).toFixed(1);
    case "f2": return Number(x).toFixed(2);
    case "f3": return Number(x).toFixed(3);
    case "pct": return (100 * x).toFixed(1) + "%";
    case "s": return Number(x).toFixed(1) + " s";
    case "bytes": {
      const units = ["B", "KiB", "MiB", "GiB", "TiB"];
      let n = Number(x), i = 0;
      while (Math.abs(n) >= 1024 && i < units.length - 1) { n /= 1024; i++; }
      return (i ? n.toFixed(n < 10 ? 2 : 1) : String(Math.round(n))) + " " + units[i];
    }
    default: return esc(x);
  }
}
function ago(t) {
  if (!t) return "—";
  const s = Math.max(0, Date.now() / 1000 - t);
  if (s < 90) return Math.round(s) + " s ago";
  if (s < 5400) return Math.round(s / 60) + " min ago";
  if (s < 172800) return Math.round(s / 3600) + " h ago";
  return Math.round(s / 86400) + " d ago";
}
function clock(t) { return t ? new Date(t * 1000).toLocaleTimeString([], { hour12: false }) : "—"; }
// a value with its JSON path
function v(path, x, f = "int") { return `<span class="v" data-k="${esc(path)}" data-f="${f}">${fmt(x, f)}</span>`; }
function tag(text, cls) { return `<span class="tag ${cls}">${esc(text)}</span>`; }
function health(ok) { return ok ? tag("healthy", "ok") : tag("down", "bad"); }
function down(part, err) { return `<div class="down">${esc(part)} unavailable <span class="muted">(${esc(err || "no answer")})</span></div>`; }

function kpi(label, html, sub = "") {
  return `<div class="kpi"><div class="label">${label}</div><div class="value">${html}</div><div class="sub">${sub}</div></div>`;
}

function renderKpis(d) {
  const last = state.lastSample || {};
  const reg = d.registry || {}, ctl = d.controller || {}, bl = d.backlog || {}, tr = d.trainer || {};
  const p = reg.pointer || {};
  const coll = ctl.collection;
  $("kpis").innerHTML = [
    kpi("Tokens/s", v("fleet.tokens_per_s", d.fleet.tokens_per_s, "f1"), `${v("fleet.available", d.fleet.available)} of ${v("fleet.workers", d.fleet.workers)} workers`),
    kpi("Running", v("fleet.running", d.fleet.running), `${v("fleet.waiting", d.fleet.waiting)} waiting`),
    kpi("Acceptance", v("history.acceptance_rate", last.acceptance_rate, "pct"), `accept length ${v("history.accept_length", last.accept_length, "f2")}`),
    kpi("γ", v("history.mean_gamma", last.mean_gamma, "f2"), "mean, last interval"),
    kpi("Effective draft", reg.available ? `<span class="name" data-k="registry.pointer.effective" data-f="str">${fmt(p.effective || "none")}</span>` : tag("registry down", "bad"),
        reg.available ? (p.is_pinned ? tag("pinned", "warn") : tag("not pinned", "info")) : ""),
    kpi("Collection", ctl.available && coll ? (coll.enabled ? tag("on", "ok") : tag("off", "")) : tag(ctl.available ? "—" : "controller down", ctl.available ? "" : "bad"),
        ctl.available && coll ? esc(coll.reason) : ""),
    kpi("Chunk backlog", bl.available ? v("backlog.buffered_chunks", bl.buffered_chunks) : tag("trainer down", "bad"),
        bl.available ? `${v("backlog.buffered_tokens", bl.buffered_tokens)} tokens` : ""),
    kpi("Dead letters", bl.available ? v("backlog.dead_letters", bl.dead_letters) : "—", tr.available ? `trainer ${esc(tr.state)}` : ""),
  ].join("");
}

function schedule(buckets) {
  if (!buckets || !buckets.length) return '<span class="muted">none</span>';
  return buckets.map((b) => tag(`${b.min_batch}${b.max_batch ? "–" + b.max_batch : "+"} ${b.enabled ? "on" : "off"}`, b.enabled ? "ok" : "")).join(" ");
}
function policy(p) {
  if (!p) return "—";
  const params = Object.entries(p.params || {}).map(([k, x]) => `${esc(k)}=${esc(x)}`).join(", ");
  return `<b>${esc(p.name)}</b>${params ? ` <span class="muted">(${params})</span>` : ""}`;
}

function memoryLine(m, k) {
  if (!m) return "";
  const spec = m.speculation_memory_budget_bytes
    ? ` · speculation memory ${v(k("memory.speculation_memory_bytes"), m.speculation_memory_bytes, "bytes")} of ${fmt(m.speculation_memory_budget_bytes, "bytes")} (${v(k("memory.speculation_memory_tokens"), m.speculation_memory_tokens)} tokens)`
    : "";
  return `<div class="why" data-memory>memory: RSS ${v(k("memory.rss_bytes"), m.rss_bytes, "bytes")} · weights ${fmt(m.weights_bytes, "bytes")} · KV cache ${fmt(m.kv_cache_bytes, "bytes")} · draft ${fmt(m.draft_bytes, "bytes")}${spec}</div>`;
}

function renderWorkers(d) {
  if (!d.workers.length) { $("workers").innerHTML = '<div class="panel muted">No worker configured.</div>'; return; }
  $("workers").innerHTML = d.workers.map((w, i) => {
    const k = (f) => `workers.${i}.${f}`;
    if (!w.available) {
      return `<div class="card" data-worker="${esc(w.name)}"><div class="head"><div><span class="name">${esc(w.name)}</span><span class="addr">${esc(w.address)}</span></div>${health(false)}</div>${down("worker", w.error)}</div>`;
    }
    const sp = w.speculation;
    const acc = w.acceptance.length ? `<table><thead><tr><th>draft version</th><th>drafter</th><th class="num">rows</th><th class="num">accept length</th><th class="num">acceptance</th></tr></thead><tbody>${
      w.acceptance.map((a, j) => `<tr><td>${esc(a.draft_version || "(none)")}</td><td>${esc(a.drafter)}</td><td class="num">${v(k(`acceptance.${j}.verify_rows`), a.verify_rows)}</td><td class="num">${v(k(`acceptance.${j}.accept_length`), a.accept_length, "f2")}</td><td class="num">${v(k(`acceptance.${j}.acceptance_rate`), a.acceptance_rate, "pct")}</td></tr>`).join("")}</tbody></table>` : '<div class="muted">No speculative step yet.</div>';
    const gam = w.gamma.length ? `<table><thead><tr><th>batch</th><th class="num">steps</th><th class="num">speculative</th><th class="num">mean γ</th><th class="num">last γ</th></tr></thead><tbody>${
      w.gamma.map((g, j) => `<tr><td>${g.min_batch === g.max_batch ? g.min_batch : `${g.min_batch}–${g.max_batch}`}</td><td class="num">${v(k(`gamma.${j}.steps`), g.steps)}</td><td class="num">${v(k(`gamma.${j}.speculative_steps`), g.speculative_steps)}</td><td class="num">${v(k(`gamma.${j}.mean_gamma`), g.mean_gamma, "f2")}</td><td class="num">${v(k(`gamma.${j}.last_gamma`), g.last_gamma)}</td></tr>`).join("")}</tbody></table>` : '<div class="muted">No step yet.</div>';
    const refusals = w.draft_refusals.length ? `<div class="why">refused: ${w.draft_refusals.map((r) => tag(`${r.version}: ${r.reason}`, "bad")).join(" ")}</div>` : "";
    return `<div class="card" data-worker="${esc(w.name)}">
      <div class="head"><div><span class="name">${esc(w.name)}</span><span class="addr">${esc(w.address)} · ${esc(w.device)} · up ${fmt(w.uptime_s / 60, "f1")} min</span></div>
        <div>${sp.on ? tag("speculating", "ok") : tag("not speculating", "warn")} ${w.collection_enabled ? tag("collecting", "info") : ""} ${health(w.healthy)}</div></div>
      <div class="stats">
        <div class="stat"><div class="label">tokens/s</div><div class="value">${v(k("tokens_per_s"), w.tokens_per_s, "f1")}</div></div>
        <div class="stat"><div class="label">running</div><div class="value">${v(k("running"), w.running)}</div></div>
        <div class="stat"><div class="label">waiting</div><div class="value">${v(k("waiting"), w.waiting)}</div></div>
        <div class="stat"><div class="label">load</div><div class="value">${v(k("load"), w.load, "pct")}</div></div>
      </div>
      <div class="why">speculation <b>${sp.on ? "on" : "off"}</b>: <span data-k="${k("speculation.why")}" data-f="str">${esc(sp.why)}</span></div>
      <div class="why">drafter <b>${esc(w.drafter)}</b> ${w.draft_version ? `version <b>${esc(w.draft_version)}</b>` : ""} · γ policy ${policy(w.gamma_policy)} · schedule ${schedule(w.schedule)}</div>
      ${memoryLine(w.memory, k)}
      ${refusals}
      <h3>Acceptance by draft version</h3>${acc}
      <h3>γ chosen per batch bucket</h3>${gam}
    </div>`;
  }).join("");
}

function renderController(c) {
  if (!c.available) { $("controller").innerHTML = down("controller", c.error); return; }
  const coll = c.collection, ld = c.last_decision, rb = c.rollback;
  const need = coll && coll.tokens_needed ? Math.min(1, coll.tokens_collected / coll.tokens_needed) : 0;
  const drafts = c.drafts.length ? `<table><thead><tr><th>draft version</th><th class="num">accept length (short / long)</th><th class="num">acceptance (short / long)</th><th class="num">verify steps</th></tr></thead><tbody>${
    c.drafts.map((x, j) => `<tr class="${x.draft_version === c.draft_version ? "effective" : ""}"><td>${esc(x.draft_version || "(none)")}</td><td class="num">${v(`controller.drafts.${j}.accept_length_short`, x.accept_length_short, "f2")} / ${v(`controller.drafts.${j}.accept_length_long`, x.accept_length_long, "f2")}</td><td class="num">${v(`controller.drafts.${j}.acceptance_rate_short`, x.acceptance_rate_short, "pct")} / ${v(`controller.drafts.${j}.acceptance_rate_long`, x.acceptance_rate_long, "pct")}</td><td class="num">${v(`controller.drafts.${j}.verify_steps`, x.verify_steps)}</td></tr>`).join("")}</tbody></table>` : '<div class="muted">No telemetry yet.</div>';
  $("controller").innerHTML = `<dl class="kv">
      <dt>collection</dt><dd>${coll ? `${coll.enabled ? tag("on", "ok") : tag("off", "")} <span data-k="controller.collection.reason" data-f="str">${esc(coll.reason)}</span>` : "—"}</dd>
      ${coll ? `<dt>collected</dt><dd>${v("controller.collection.tokens_collected", coll.tokens_collected)} of ${v("controller.collection.tokens_needed", coll.tokens_needed)} tokens<div class="bar"><div style="width:${(100 * need).toFixed(1)}%"></div></div></dd>` : ""}
      <dt>last decision</dt><dd>${ld ? `<b>${esc(ld.decision_id)}</b> ${ago(ld.issued_unix_s)} · applied to ${v("controller.last_decision.applied_to.length", ld.applied_to.length)} worker(s)${ld.failed.length ? `, ${tag(ld.failed.length + " failed", "bad")}` : ""}<div>reason: <b data-k="controller.last_decision.reason" data-f="str">${esc(ld.reason || "—")}</b></div>` : '<span class="muted">none yet</span>'}</dd>
      <dt>speculation</dt><dd>${schedule(c.schedule)}</dd>
      <dt>γ policy</dt><dd>${policy(c.gamma_policy)}</dd>
      <dt>auto rollback</dt><dd>${rb ? (rb.enabled ? (rb.watching_version ? `watching <b>${esc(rb.watching_version)}</b> vs ${esc(rb.previous_version)} (${v("controller.rollback.verify_steps", rb.verify_steps)} / ${v("controller.rollback.window", rb.window)} steps)` : "on, nothing to watch") : "off") : "—"}${rb && rb.last ? `<div>last: ${esc(rb.last.from_version)} → ${esc(rb.last.to_version)} ${ago(rb.last.time_unix_s)}</div>` : ""}</dd>
    </dl><h3>Live acceptance by draft version (fleet EMAs)</h3>${drafts}`;
}

function renderRegistry(r) {
  if (!r.available) { $("registry").innerHTML = down("registry", r.error); return; }
  const p = r.pointer;
  const metric = (m, key, f) => (key in m ? fmt(m[key], f) : "—");
  const rows = r.versions.map((x, j) => `<tr class="${x.effective ? "effective" : ""}" data-version="${esc(x.version)}"><td>${esc(x.version)} ${x.effective ? tag("effective", "info") : ""}${x.pinned ? " " + tag("pinned", "warn") : ""}</td>
      <td class="num"><span data-k="registry.versions.${j}.eval_metrics.accept_length" data-f="f3">${metric(x.eval_metrics, "accept_length", "f3")}</span></td>
      <td class="num"><span data-k="registry.versions.${j}.eval_metrics.accept_length_base" data-f="f3">${metric(x.eval_metrics, "accept_length_base", "f3")}</span></td>
      <td class="num"><span data-k="registry.versions.${j}.eval_metrics.train_tokens" data-f="int">${metric(x.eval_metrics, "train_tokens", "int")}</span></td>
      <td>${ago(x.created_unix_s)}</td></tr>`).join("");
  $("registry").innerHTML = `<dl class="kv">
      <dt>effective</dt><dd><b data-k="registry.pointer.effective" data-f="str">${esc(p.effective || "none")}</b> ${p.is_pinned ? tag("pinned", "warn") : tag("not pinned", "info")}</dd>
      <dt>current</dt><dd>${esc(p.current || "none")} <span class="muted">generation ${v("registry.pointer.generation", p.generation)}</span></dd>
      <dt>pinned</dt><dd>${esc(p.pinned || "—")}</dd>
      <dt>versions</dt><dd>${v("registry.versions.length", r.versions.length)}</dd>
    </dl>${r.versions.length ? `<table><thead><tr><th>version</th><th class="num">eval accept length</th><th class="num">base</th><th class="num">train tokens</th><th>created</th></tr></thead><tbody>${rows}</tbody></table>` : '<div class="muted">No draft registered.</div>'}`;
}

function renderTraining(d) {
  const t = d.trainer, tr = d.training || { cycles: [] };
  const head = t.available ? `<dl class="kv"><dt>trainer</dt><dd>${tag(t.state, t.state === "idle" ? "" : "info")} ${t.run_id ? esc(t.run_id) : ""}</dd>
      ${t.state !== "idle" ? `<dt>progress</dt><dd>${v("trainer.progress", t.progress, "pct")} · loss ${v("trainer.loss", t.loss, "f3")}</dd>` : ""}
      <dt>chunks</dt><dd>${v("trainer.chunks_consumed", t.chunks_consumed)} consumed · ${v("trainer.chunks_deduplicated", t.chunks_deduplicated)} duplicates · ${v("trainer.chunks_dead_lettered", t.chunks_dead_lettered)} dead-lettered</dd></dl>` : down("trainer", t.error);
  const cycles = tr.cycles && tr.cycles.length ? `<table><thead><tr><th>cycle</th><th class="num">tokens</th><th class="num">duration</th><th class="num">eval before → after</th><th>result</th></tr></thead><tbody>${
    tr.cycles.map((c, j) => `<tr><td>${esc(c.candidate_version || c.run_id)}<div class="muted">${ago(c.time_unix_s)}</div></td><td class="num">${v(`training.cycles.${j}.train_tokens`, c.train_tokens)}</td><td class="num">${v(`training.cycles.${j}.duration_s`, c.duration_s, "s")}</td><td class="num">${v(`training.cycles.${j}.eval_before`, c.eval_before, "f3")} → ${v(`training.cycles.${j}.eval_after`, c.eval_after, "f3")}</td><td>${c.promoted ? tag("promoted", "ok") : tag("kept base", "")}</td></tr>`).join("")}</tbody></table>` : '<div class="muted">No training cycle yet.</div>';
  $("training").innerHTML = `${head}<h3>Cycles</h3>${cycles}`;
}

// The governed store (docs/data-handling.md): the trainer's trainer.data, and this gateway's opt_out.
const DELETE_REASONS = ["retention_consumed", "retention_unconsumed", "budget", "forget"];
function renderData(d) {
  const t = d.trainer || {}, data = t.data, oo = d.opt_out;
  let store;
  if (!t.available) store = down("trainer", t.error);
  else if (!data) store = '<div class="muted">The trainer reports no data store.</div>';
  else {
    const budget = data.bucket_budget_bytes, used = data.bucket_chunk_bytes;
    const share = budget ? Math.min(1, used / budget) : 0;
    const over = budget && used > budget;
    const reasons = [...new Set([...DELETE_REASONS, ...Object.keys(data.chunks_deleted || {})])];
    const counts = data.chunks_deleted || {};  // reasons with no deletion yet are absent: 0
    const deleted = reasons.map((r) => `<tr data-reason="${esc(r)}"><td>${esc(r)}</td><td class="num">${r in counts ? v(`trainer.data.chunks_deleted.${r}`, counts[r]) : "0"}</td></tr>`).join("");
    store = `<dl class="kv">
      <dt>bucket</dt><dd>${v("trainer.data.bucket_chunk_bytes", used, "bytes")} of ${budget ? v("trainer.data.bucket_budget_bytes", budget, "bytes") : '<span class="muted">no budget</span>'}
        ${budget ? `${tag(fmt(share, "pct"), over ? "warn" : "ok")}<div class="bar"><div style="width:${(100 * share).toFixed(1)}%"></div></div>` : ""}</dd>
      <dt>deleted</dt><dd>${v("trainer.data.chunk_bytes_deleted", data.chunk_bytes_deleted, "bytes")} in all</dd>
      <dt>quarantined</dt><dd>${v("trainer.data.chunks_quarantined", data.chunks_quarantined)} chunks ${data.chunks_quarantined ? tag("failed authentication or checks", "bad") : ""}</dd>
      <dt>stream trimmed</dt><dd>${v("trainer.data.stream_entries_trimmed", data.stream_entries_trimmed)} entries</dd>
    </dl><h3>Chunks deleted by reason</h3><table><thead><tr><th>reason</th><th class="num">chunks</th></tr></thead><tbody>${deleted}</tbody></table>`;
  }
  let opt = "";
  if (oo && oo.available) {
    const rows = Object.entries(oo.excluded || {}).map(([r, n]) => `<tr data-excluded="${esc(r)}"><td>${esc(r)}</td><td class="num">${v(`opt_out.excluded.${r}`, n)}</td></tr>`).join("");
    opt = `<h3>Opt-out <small class="muted">this gateway's requests since ${clock(oo.since_unix_s)} (X-TIDE-Training)</small></h3>
      <dl class="kv"><dt>eligible</dt><dd>${v("opt_out.eligible", oo.eligible)}</dd>
      <dt>excluded</dt><dd>${v("opt_out.excluded_total", oo.excluded_total)}</dd></dl>
      ${rows ? `<table><thead><tr><th>excluded because</th><th class="num">requests</th></tr></thead><tbody>${rows}</tbody></table>` : ""}`;
  }
  $("data").innerHTML = `<div class="two"><div>${store}</div><div>${opt || '<div class="muted">No opt-out counts.</div>'}</div></div>`;
}

const KINDS = { training: ["trained", "info"], promote: ["promoted", "ok"], rollback: ["rolled back", "bad"], pin: ["pinned", "warn"], unpin: ["unpinned", ""] };
function renderTimeline(d) {
  const tl = (d.training && d.training.timeline) || [];
  const counts = `<div class="why">${v("training.promotions", d.training ? d.training.promotions : null)} promotions · ${v("training.rollbacks", d.training ? d.training.rollbacks : null)} rollbacks</div>`;
  $("timeline").innerHTML = counts + (tl.length ? `<ul class="timeline">${tl.map((e) => {
    const [label, cls] = KINDS[e.kind] || [e.kind, ""];
    const what = e.kind === "training" ? `${esc(e.from_version || "—")} → ${esc(e.version || "(not registered)")}` : `${esc(e.from_version || "—")} → ${esc(e.version || "—")}`;
    return `<li data-kind="${esc(e.kind)}"><span class="muted">${clock(e.time_unix_s)}</span>${tag(label, cls)}<span>${what}${e.reason ? ` <span class="muted">· ${esc(e.reason)}</span>` : ""}</span></li>`;
  }).join("")}</ul>` : '<div class="muted">Nothing yet.</div>');
}

function renderServices(d) {
  const rows = Object.entries(d.services).map(([name, s]) => `<tr data-service="${esc(name)}"><td><b>${esc(name)}</b></td><td class="muted">${esc(s.address || "—")}</td><td>${health(s.healthy)}</td><td>${esc(s.state)}</td><td class="num">${s.restarts === null ? "—" : v(`services.${name}.restarts`, s.restarts)}</td></tr>`).join("");
  $("services").innerHTML = `<table><thead><tr><th>service</th><th>address</th><th>health</th><th>state</th><th class="num">restarts</th></tr></thead><tbody>${rows}</tbody></table>
    ${d.supervised ? "" : '<div class="muted">Not under tide up: restarts are not visible here.</div>'}`;
}

// ------------------------------------------------------------------ charts (inline SVG)

const H = 160, L = 44, R = 10, T = 12, B = 22;
function chart(el, series, opts = {}) {
  const W = Math.max(300, Math.round(el.clientWidth || 600)); // drawn at the element's size: text never scales
  const now = Date.now() / 1000, span = opts.span || 3600;
  const t0 = Math.max(now - span, Math.min(now - 60, ...series.flatMap((s) => s.points.map((p) => p[0]))));
  const pts = series.flatMap((s) => s.points.filter((p) => p[1] !== null && p[1] !== undefined));
  let ymax = Math.max(opts.ymin || 0, ...pts.map((p) => p[1]));
  if (opts.ymax !== undefined) ymax = opts.ymax; else ymax = ymax <= 0 ? 1 : ymax * 1.15;
  const x = (t) => L + ((t - t0) / (now - t0)) * (W - L - R);
  const y = (val) => T + (1 - val / ymax) * (H - T - B);
  let svg = `<svg viewBox="0 0 ${W} ${H}" role="img">`;
  for (let i = 0; i <= 4; i++) {
    const val = (ymax * i) / 4, yy = y(val);
    svg += `<line class="axis" x1="${L}" x2="${W - R}" y1="${yy}" y2="${yy}" stroke-dasharray="${i ? "2 3" : ""}"/><text x="${L - 6}" y="${yy + 3}" text-anchor="end">${opts.yfmt ? opts.yfmt(val) : val.toFixed(val < 10 ? 1 : 0)}</text>`;
  }
  const mins = (now - t0) / 60;
  for (let i = 0; i <= 4; i += 2) {
    const t = t0 + ((now - t0) * i) / 4;
    svg += `<text x="${x(t)}" y="${H - 6}" text-anchor="${i === 0 ? "start" : i === 4 ? "end" : "middle"}">${i === 4 ? "now" : "−" + (mins * (1 - i / 4)).toFixed(mins < 8 ? 1 : 0) + " min"}</text>`;
  }
  if (!pts.length) svg += `<text class="empty" x="${(W + L) / 2}" y="${H / 2}" text-anchor="middle">no data yet</text>`;
  series.forEach((s) => {
    const segs = []; let cur = [];
    s.points.forEach((p) => { if (p[1] === null || p[1] === undefined) { if (cur.length) segs.push(cur); cur = []; } else cur.push(p); });
    if (cur.length) segs.push(cur);
    segs.forEach((seg) => {
      const d = seg.map((p, i) => `${i ? "L" : "M"}${x(p[0]).toFixed(1)},${y(p[1]).toFixed(1)}`).join("");
      if (s.fill && seg.length > 1) svg += `<path d="${d}L${x(seg[seg.length - 1][0]).toFixed(1)},${y(0)}L${x(seg[0][0]).toFixed(1)},${y(0)}Z" fill="${s.color}" opacity=".12"/>`;
      svg += `<path d="${d}" fill="none" stroke="${s.color}" stroke-width="2" stroke-linejoin="round"/>`;
      if (seg.length === 1) svg += `<circle cx="${x(seg[0][0])}" cy="${y(seg[0][1])}" r="2.5" fill="${s.color}"/>`;
    });
  });
  let lx = L + 8;
  series.forEach((s) => {
    const last = [...s.points].reverse().find((p) => p[1] !== null && p[1] !== undefined);
    const label = `${s.name}${last ? ": " + (opts.yfmt ? opts.yfmt(last[1]) : last[1].toFixed(2)) : ""}`;
    svg += `<rect x="${lx}" y="${T - 2}" width="10" height="3" fill="${s.color}"/><text x="${lx + 14}" y="${T + 2}" style="fill:#e6eaf2">${esc(label)}</text>`;
    lx += 24 + label.length * 6;
  });
  el.innerHTML = svg + "</svg>";
}

const COLORS = ["#6ea8fe", "#c792ea", "#4dd0e1", "#f5b84d", "#3ecf8e", "#ef5f67"];
function renderCharts() {
  const h = state.history;
  const pts = (f) => h.map((s) => [s.time_unix_s, typeof f === "function" ? f(s) : s[f]]);
  const names = [...new Set(h.flatMap((s) => Object.keys(s.workers_tokens_per_s || {})))];
  const tok = [{ name: "fleet", color: COLORS[0], points: pts("tokens_per_s"), fill: true }];
  if (names.length > 1) names.forEach((n, i) => tok.push({ name: n, color: COLORS[(i + 1) % COLORS.length], points: pts((s) => (s.workers_tokens_per_s || {})[n] ?? null) }));
  chart($("chart-tokens"), tok, { yfmt: (x) => x.toFixed(x < 10 ? 1 : 0) });
  chart($("chart-acceptance"), [{ name: "acceptance", color: COLORS[4], points: pts("acceptance_rate"), fill: true }], { ymax: 1, yfmt: (x) => (100 * x).toFixed(0) + "%" });
  chart($("chart-gamma"), [{ name: "mean γ", color: COLORS[1], points: pts("mean_gamma"), fill: true }], { yfmt: (x) => x.toFixed(1) });
  chart($("chart-backlog"), [{ name: "buffered chunks", color: COLORS[3], points: pts("buffered_chunks"), fill: true },
                             { name: "dead letters", color: COLORS[5], points: pts("dead_letters") }], { ymin: 4, yfmt: (x) => x.toFixed(0) });
}

// ------------------------------------------------------------------ polling

function render(d) {
  const st = $("status");
  st.dataset.state = d.status; st.textContent = d.status === "ok" ? "all ok" : "degraded: " + d.degraded.join(", ");
  $("target-model").textContent = d.target_model || "—";
  $("updated").textContent = clock(d.time_unix_s);
  document.body.dataset.docTime = String(d.time_unix_s);
  renderKpis(d); renderWorkers(d); renderController(d.controller); renderRegistry(d.registry);
  renderTraining(d); renderTimeline(d); renderData(d); renderServices(d);
  window.tideStatus = d;
  document.body.dataset.rendered = String((Number(document.body.dataset.rendered) || 0) + 1);
}

async function pollStatus() {
  try {
    const r = await fetch("/v1/status", { cache: "no-store" });
    if (!r.ok) throw new Error("HTTP " + r.status);
    state.doc = await r.json();
    render(state.doc);
    $("fetch-error").hidden = true;
  } catch (e) {
    $("fetch-error").hidden = false; $("fetch-error").textContent = "gateway unreachable (" + e.message + ")";
    $("status").dataset.state = "down"; $("status").textContent = "no answer";
  }
}

async function pollHistory() {
  try {
    const since = state.history.length ? state.history[state.history.length - 1].time_unix_s : null;
    const r = await fetch("/v1/status/history" + (since ? "?since=" + since : ""), { cache: "no-store" });
    if (!r.ok) throw new Error("HTTP " + r.status);
    const h = await r.json();
    state.interval = h.interval_s;
    state.history = state.history.concat(h.samples).slice(-Math.ceil(h.window_s / h.interval_s));
    state.lastSample = state.history.length ? state.history[state.history.length - 1] : null;
    window.tideHistory = state.history;
    renderCharts();
    if (state.doc) renderKpis(state.doc);
    document.body.dataset.historyRendered = String(state.history.length);
  } catch (e) { /* the status poll shows the outage */ }
}

pollStatus(); pollHistory();
setInterval(pollStatus, STATUS_EVERY_MS);
setInterval(pollHistory, HISTORY_EVERY_MS);
window.addEventListener("resize", () => { if (state.history.length) renderCharts(); });
