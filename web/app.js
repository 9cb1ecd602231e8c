// rollout-gateway status page: a view of GET /status, kept live by GET /status/stream (SSE).
// Plain JavaScript and SVG, no dependencies. Text from the server is only ever set with
// textContent, never parsed as HTML.
"use strict";

(() => {
  const TOKEN_KEY = "rollout-gateway.admin-token";
  const PHASES = ["generating", "queued", "tool", "finished"];
  const $ = (id) => document.getElementById(id);
  let latest = null;
  let staleTimer = null;

  // ---------- small helpers ----------
  const { el, svg, num, dur, niceStep } = window.RG;
  function setText(id, text) {
    const node = $(id);
    if (node && node.textContent !== text) node.textContent = text;
  }
  function pct(x) { return x === null || x === undefined ? "–" : (100 * x).toFixed(x < 0.1 ? 1 : 0) + "%"; }
  function clock(ts) { return new Date(ts * 1000).toLocaleTimeString("en-GB", { hour12: false }); }
  function chartBox(id, height) {
    const host = $(id);
    const width = Math.max(240, host.clientWidth || 600);
    const root = svg("svg", { viewBox: `0 0 ${width} ${height}`, height, role: "img" });
    host.replaceChildren(root);
    return { root, width, height };
  }

  // ---------- connection ----------
  function setConn(state) {
    const pill = $("conn");
    pill.dataset.state = state;
    pill.textContent = state;
  }
  function connect() {
    const stream = new EventSource("/status/stream");
    stream.addEventListener("status", (ev) => {
      clearTimeout(staleTimer);
      setConn("live");
      render(JSON.parse(ev.data));
      // Each stream ends after a while and EventSource reconnects by itself; only call it
      // reconnecting when no data came for a few seconds.
      staleTimer = setTimeout(() => setConn("reconnecting"), 4000);
    });
  }

  // ---------- rendering ----------
  function render(s) {
    latest = s;
    setText("policy", s.policy);
    setText("weight-version", s.weight_version);
    $("paused").hidden = !s.paused;  // paused for a weight sync (admin pause/resume)
    setText("uptime", dur(s.server_time - s.started_at));
    renderKpis(s);
    renderPhases(s);
    renderWriter(s.trace_writer);
    renderPool(s);
    renderThroughput(s.history);
    renderGantt(s.gantt);
    renderLengths(s.lengths);
    renderEvents(s.events);
    renderMismatch(s.training_mismatch);
    renderPolicies(s);
  }

  function renderKpis(s) {
    const t = s.totals, r = s.rates, p = s.pool, tr = s.trajectories.by_phase;
    setText("kpi-tokens-per-s", num(r.tokens_per_s));
    setText("kpi-tokens-total", num(t.completion_tokens) + " generated");
    setText("kpi-calls-per-s", num(r.calls_per_s, 2));
    setText("kpi-calls-total", num(t.calls) + " calls · " + num(t.calls_failed) + " failed");
    setText("kpi-running", num(p.running));
    setText("kpi-queued", num(p.queued) + " queued in gateway");
    const live = tr.generating + tr.queued + tr.tool;
    setText("kpi-trajectories", num(live));
    setText("kpi-finished", "live · " + num(tr.finished) + " finished");
    setText("kpi-queue-p90", dur(s.latency.queue_p90_s));
    setText("kpi-ttft", "TTFT p50 " + dur(s.latency.ttft_p50_s));
    setText("kpi-pool", p.routable + " / " + p.instances);
    setText("kpi-gpus", "routable · " + p.gpus + " GPUs");
  }

  function renderPhases(s) {
    const by = s.trajectories.by_phase;
    const total = PHASES.reduce((a, k) => a + (by[k] || 0), 0);
    setText("traj-total", num(total) + " total");
    const bar = $("phase-bar");
    if (bar.children.length !== PHASES.length) {
      bar.replaceChildren(...PHASES.map((k) => el("span", { class: "c-" + k, title: k })));
      $("phase-legend").replaceChildren(...PHASES.map((k) => {
        const li = el("li");
        li.append(el("span", { class: "dot c-" + k }), el("span", {}, k),
          el("span", { class: "n", id: "phase-" + k }, "0"));
        return li;
      }));
    }
    PHASES.forEach((k, i) => {
      bar.children[i].style.width = total ? (100 * (by[k] || 0) / total) + "%" : "0";
      setText("phase-" + k, num(by[k] || 0));
    });
  }

  function renderWriter(w) {
    setText("writer-queue", num(w.queue_depth));
    setText("writer-written", num(w.written));
    setText("writer-dropped", num(w.dropped));
    setText("writer-errors", num(w.write_errors));
    setText("writer-quarantined", num(w.quarantined || 0));
    $("writer-dropped").classList.toggle("bad", w.dropped > 0);
    $("writer-quarantined").classList.toggle("bad", w.quarantined > 0);
    $("writer-errors").classList.toggle("bad", w.write_errors > 0);
    const refusing = w.recording === false;
    $("recording").hidden = !refusing;
    $("recording").title = w.refusal || "";
    const lost = Object.entries(w.lost || {}).map(([why, n]) => `${num(n)} ${why}`).join(", ");
    const note = $("writer-note");
    const problem = refusing ? "Not recording, model calls refused: " + w.refusal
      : w.db_ok === false ? "Database unreachable" + (w.spooled ? `: ${num(w.spooled)} records spooled to disk` : "")
      : w.last_error ? "Last write error: " + w.last_error : "";
    const parts = [problem, lost && "lost: " + lost,
      w.quarantined ? `${num(w.quarantined)} quarantined in ${w.quarantine_file}` : ""];
    note.textContent = parts.filter(Boolean).join(" · ");
    note.hidden = !note.textContent;
    note.classList.toggle("bad", refusing || w.dropped > 0);
  }

  function stateClass(b) {
    if (!b.healthy) return "bad";
    return b.state === "ready" ? "ok" : "warn";
  }
  function meter(frac) {
    const wrap = el("span");
    const m = el("span", { class: "meter" + (frac >= 0.95 ? " full" : frac >= 0.8 ? " high" : "") });
    const fill = el("span");
    fill.style.width = Math.min(100, Math.max(0, 100 * frac)) + "%";
    m.append(fill);
    wrap.append(m, el("span", { class: "meter-label" }, pct(frac)));
    return wrap;
  }
  function renderPool(s) {
    const rows = s.backends.map((b) => {
      const e = b.engine || {};
      const tr = el("tr");
      const name = el("td");
      name.append(el("b", {}, b.id));
      // the engine's address is in /status for the operator only (docs/status-page.md)
      if (b.url) name.append(el("span", { class: "url" }, b.url));
      const state = el("td");
      state.append(el("span", { class: "state " + stateClass(b), title: b.last_error || "" },
        b.healthy ? b.state : "unhealthy"));
      const kv = el("td");
      if (e.kv_usage === null || e.kv_usage === undefined) kv.textContent = "–"; else kv.append(meter(e.kv_usage));
      const running = e.running ?? b.in_flight;
      tr.append(name, state,
        el("td", { class: "num" }, String(b.gpus.length || b.tp)),
        el("td", { class: "num" }, String(b.tp)),
        el("td", { class: "num", title: `${b.in_flight} in flight from the gateway` }, num(running)),
        el("td", { class: "num" }, num(e.waiting ?? null)),
        kv,
        el("td", { class: "num" }, num(e.tokens_per_s ?? null)),
        el("td", { class: "num" }, pct(e.prefix_hit_rate ?? null)),
        el("td", { class: "num" }, num(b.served)));
      return tr;
    });
    $("pool").tBodies[0].replaceChildren(...rows);
    $("pool-empty").hidden = rows.length > 0;
    const rl = s.relayouts;
    const relayouts = rl && rl.proposed ? ` · relayouts ${rl.applied} applied of ${rl.proposed} proposed` +
      (rl.applied ? ` (drain ${dur(rl.drain_s)}, start ${dur(rl.start_s)})` : "") : "";
    setText("pool-summary", `${s.pool.instances} instances · ${s.pool.gpus} GPUs` + relayouts);
    renderSpeeds(s.speeds);
    renderModels(s.models);
  }

  // per model calls ask for (a served model, a LoRA family of one): its version and load
  function renderModels(models) {
    if (!models) return;
    const rows = Object.entries(models).map(([name, m]) => {
      const tr = el("tr", { "data-model": name });
      const t = m.trajectories || {};
      const cell = el("td");  // its trajectories in the viewer
      cell.append(el("a", { href: "/view/search?model=" + encodeURIComponent(name) }, name));
      tr.append(
        cell,
        el("td", {}, m.base ?? "—"),
        el("td", { class: "version" }, String(m.version)),
        el("td", {}, m.adapter ?? "—"),
        el("td", { class: "num" }, m.max_staleness == null ? "none" : String(m.max_staleness)),
        el("td", { class: "num" }, num(t.queued ?? 0)),
        el("td", { class: "num" }, num(t.generating ?? 0)),
        el("td", { class: "num" }, num(t.tool ?? 0)));
      return tr;
    });
    $("models").tBodies[0].replaceChildren(...rows);
  }

  // per TP: the decode step the policy plans with (profile x what the engines measured)
  function renderSpeeds(sp) {
    if (!sp) return;
    setText("speeds-profile", `profile ${sp.profile}`);
    const rows = sp.by_tp.map((r) => {
      const tr = el("tr", { "data-tp": String(r.tp) });
      tr.append(
        el("td", { class: "num" }, String(r.tp)),
        el("td", { class: "num" }, `${r.step_ms_1.toFixed(1)} ms`),
        el("td", { class: "num" }, `${r.step_ms_64.toFixed(1)} ms`),
        el("td", { class: "num" }, r.factor.toFixed(2)),
        el("td", { class: "source" }, r.source),
        el("td", { class: "num" }, num(r.calls)));
      return tr;
    });
    $("speeds").tBodies[0].replaceChildren(...rows);
  }

  // One row per (report, weight version), newest report first; alarms in red.
  function renderMismatch(m) {
    if (!m) return;
    const sci = (x) => (x === 0 ? "0" : x < 0.001 ? x.toExponential(1) : x.toFixed(4));
    setText("mismatch-summary", `${num(m.reports)} reports, ${num(m.alarms)} alarms; limits KL ${m.limits.kl}, ` +
      `outside ${pct(m.limits.outside_share)}, |Δ| ${m.limits.mean_abs_diff}`);
    const rows = [];
    for (const r of m.recent) {
      // free tokens per version; a constrained call's tokens (masked logprobs) apart
      const parts = Object.entries(r.by_version);
      if (r.constrained) parts.push(["constrained", r.constrained]);
      for (const [version, st] of parts) {
        const free = version !== "constrained";
        const tr = el("tr", { "data-step": String(r.step), "data-version": version });
        const alarm = el("td", { class: "alarm" }, !free ? "not judged: masked logprobs"
          : r.alarms.length ? "⚠ " + r.alarms.join("; ") : "–");
        tr.classList.toggle("bad", free && r.alarms.length > 0);
        tr.classList.toggle("constrained", !free);
        tr.append(
          el("td", { class: "num" }, r.step === null ? "–" : String(r.step)),
          el("td", {}, r.mode), el("td", {}, version),
          el("td", { class: "num" }, num(st.tokens)),
          el("td", { class: "num" }, sci(st.mean_abs_diff)),
          el("td", { class: "num" }, sci(st.kl)),
          el("td", { class: "num" }, st.ratio_percentiles.p1.toFixed(3)),
          el("td", { class: "num" }, st.ratio_percentiles.p50.toFixed(3)),
          el("td", { class: "num" }, st.ratio_percentiles.p99.toFixed(3)),
          el("td", { class: "num" }, pct(st.outside_share)), alarm);
        rows.push(tr);
      }
    }
    $("mismatch").tBodies[0].replaceChildren(...rows);
    $("mismatch-empty").hidden = rows.length > 0;
  }

  function renderThroughput(h) {
    const pts = h.points;
    const { root, width, height } = chartBox("throughput", 220);
    const m = { l: 48, r: 12, t: 10, b: 24 };
    if (pts.length < 2) {
      root.append(svg("text", { x: width / 2, y: height / 2, "text-anchor": "middle" }, "collecting samples…"));
      return;
    }
    const t0 = pts[0][0], t1 = pts[pts.length - 1][0];
    const maxY = Math.max(1, ...pts.map((p) => p[1]));
    const step = niceStep(maxY, 4), top = Math.ceil(maxY / step) * step;
    const x = (t) => m.l + (width - m.l - m.r) * ((t - t0) / Math.max(1e-9, t1 - t0));
    const y = (v) => m.t + (height - m.t - m.b) * (1 - v / top);
    for (let v = 0; v <= top + 1e-9; v += step) {
      root.append(svg("line", { class: "gridline", x1: m.l, x2: width - m.r, y1: y(v), y2: y(v) }),
        svg("text", { x: m.l - 6, y: y(v) + 4, "text-anchor": "end" }, num(v)));
    }
    const span = t1 - t0, tstep = niceStep(span, Math.max(2, Math.floor(width / 110)));
    for (let ago = 0; ago <= span + 1e-9; ago += tstep) {
      root.append(svg("text", { x: x(t1 - ago), y: height - 6, "text-anchor": "middle" },
        ago === 0 ? "now" : "-" + dur(ago).replace(" ", "")));
    }
    const line = (i) => pts.map((p, k) => (k ? "L" : "M") + x(p[0]).toFixed(1) + "," + y(p[i]).toFixed(1)).join("");
    root.append(
      svg("path", { class: "area", d: line(1) + `L${x(t1)},${y(0)}L${x(t0)},${y(0)}Z` }),
      svg("path", { class: "line", d: line(1) }));
  }

  function renderGantt(g) {
    const rows = g.rows;
    $("gantt-empty").hidden = rows.length > 0;
    if (!rows.length) { $("gantt").replaceChildren(); return; }
    const rowH = 24, m = { t: 4, b: 22 };
    const { root, width, height } = chartBox("gantt", m.t + rows.length * rowH + m.b);
    const labelW = Math.min(170, Math.max(90, width * 0.22));
    const end = Math.max(g.now, ...rows.map((r) => r.end), 1e-3);
    const plotW = width - labelW - 64;
    const x = (t) => labelW + plotW * (t / end);
    const tstep = niceStep(end, Math.max(2, Math.floor(plotW / 90)));
    for (let t = 0; t <= end + 1e-9; t += tstep) {
      root.append(svg("line", { class: "gridline", x1: x(t), x2: x(t), y1: m.t, y2: height - m.b }),
        svg("text", { x: x(t), y: height - 6, "text-anchor": "middle" }, dur(t).replace(" ", "")));
    }
    rows.forEach((r, i) => {
      const yTop = m.t + i * rowH;
      const group = svg("g", { class: "row", "data-id": r.id, tabindex: 0 });
      group.append(svg("title", {}, `${r.id} · ${r.phase} · ${r.turns} turns · ${num(r.completion_tokens)} tokens\n` +
        `LLM ${dur(r.llm_s)} · queued ${dur(r.queue_s)} · tool ${dur(r.tool_s)}` + (r.backend_id ? ` · on ${r.backend_id}` : "")));
      const label = r.id.length > 22 ? r.id.slice(0, 10) + "…" + r.id.slice(-10) : r.id;
      group.append(svg("text", { class: "row-label", x: 0, y: yTop + rowH / 2 + 4 }, label));
      group.append(svg("rect", { class: "track", x: x(r.start), y: yTop + 5, width: Math.max(1, x(r.end) - x(r.start)), height: rowH - 10, rx: 3 }));
      for (const [kind, a, b] of r.segments) {
        group.append(svg("rect", { class: "seg-" + kind, x: x(a), y: yTop + 5, width: Math.max(1, x(b) - x(a)), height: rowH - 10 }));
      }
      group.append(svg("text", { x: x(r.end) + 6, y: yTop + rowH / 2 + 4 }, dur(r.end - r.start).replace(" ", "") + (r.phase === "finished" ? "" : " …")));
      group.addEventListener("click", () => openTrajectory(r.id));
      group.addEventListener("keydown", (ev) => { if (ev.key === "Enter") openTrajectory(r.id); });
      root.append(group);
    });
    // Layout changes the pool applied (drain + stop + start), as bands across the rows.
    for (const [a, b, label] of g.relayouts || []) {
      const band = svg("rect", { class: "relayout", x: x(a), y: m.t, width: Math.max(2, x(b ?? g.now) - x(a)), height: height - m.t - m.b });
      band.append(svg("title", {}, `relayout ${label}: ${b === null ? "in progress" : dur(b - a)}`));
      root.append(band);
    }
    root.append(svg("line", { class: "now", x1: x(g.now), x2: x(g.now), y1: m.t, y2: height - m.b }));
  }

  function renderLengths(d) {
    setText("len-p50", num(d.p50)); setText("len-p90", num(d.p90));
    setText("len-p99", num(d.p99)); setText("len-max", num(d.max));
    const { root, width, height } = chartBox("lengths", 170);
    if (!d.count) {
      root.append(svg("text", { x: width / 2, y: height / 2, "text-anchor": "middle" }, "no finished calls yet"));
      return;
    }
    const m = { l: 30, r: 6, t: 16, b: 22 };
    const bins = d.bins, bw = (width - m.l - m.r) / bins.length;
    const maxC = Math.max(...bins.map((b) => b.count));
    const y = (c) => m.t + (height - m.t - m.b) * (1 - c / maxC);
    root.append(svg("text", { x: m.l - 4, y: m.t + 4, "text-anchor": "end" }, num(maxC)),
      svg("line", { class: "axis", x1: m.l, x2: width - m.r, y1: y(0), y2: y(0) }));
    const labelEvery = Math.ceil(bins.length / Math.max(1, Math.floor(width / 46)));
    bins.forEach((b, i) => {
      const rect = svg("rect", { class: "bar" + (d.p90 !== null && b.lo > d.p90 ? " tail" : ""),
        x: m.l + i * bw + 1, y: y(b.count), width: Math.max(1, bw - 2), height: y(0) - y(b.count), rx: 2 });
      rect.append(svg("title", {}, `${num(b.lo)}–${num(b.hi)} tokens: ${b.count}`));
      root.append(rect);
      if (i % labelEvery === 0) root.append(svg("text", { x: m.l + i * bw + bw / 2, y: height - 6, "text-anchor": "middle" }, num(b.lo)));
    });
    const xOf = (v) => {
      const i = bins.findIndex((b) => v >= b.lo && v <= b.hi);
      if (i < 0) return null;
      const b = bins[i];
      return m.l + i * bw + bw * ((v - b.lo + 0.5) / (b.hi - b.lo + 1));
    };
    for (const [name, v] of [["p50", d.p50], ["p90", d.p90], ["p99", d.p99]]) {
      const xv = xOf(v);
      if (xv === null) continue;
      root.append(svg("line", { class: "marker", x1: xv, x2: xv, y1: m.t - 2, y2: y(0) }),
        svg("text", { class: "marker-label", x: xv, y: m.t - 5, "text-anchor": "middle" }, name));
    }
  }

  function renderEvents(events) {
    $("events-empty").hidden = events.length > 0;
    $("events").replaceChildren(...events.map((e) => {
      const li = el("li");
      li.append(el("time", { datetime: new Date(e.ts * 1000).toISOString() }, clock(e.ts)),
        el("span", { class: "kind kind-" + e.kind }, e.kind.replace("_", " ")),
        el("span", { class: "msg" }, e.message));
      return li;
    }));
  }

  function renderPolicies(s) {
    const names = s.policies || [];
    const list = $("policy-names");
    if (list.dataset.names === names.join(",")) return;
    list.dataset.names = names.join(",");
    list.replaceChildren(...names.map((n) => el("option", { value: n })));
  }

  // ---------- admin ----------
  function token() { return sessionStorage.getItem(TOKEN_KEY) || ""; }
  function authHeaders() {
    const t = token();
    return t ? { Authorization: "Bearer " + t } : {};
  }
  function showTokenState() {
    setText("admin-state", token() ? "token set for this tab" : "token not set");
  }
  function result(text, ok) {
    const r = $("admin-result");
    r.textContent = text;
    r.className = "result " + (ok ? "ok" : "bad");
  }
  async function admin(method, path, body, done) {
    const buttons = document.querySelectorAll("#admin-card button");
    buttons.forEach((b) => { b.disabled = true; });
    try {
      const resp = await fetch(path, {
        method, headers: { ...authHeaders(), ...(body ? { "Content-Type": "application/json" } : {}) },
        body: body ? JSON.stringify(body) : undefined,
      });
      const data = await resp.json().catch(() => ({}));
      if (resp.ok) { result(done(data), true); return; }
      const detail = typeof data.detail === "string" ? data.detail
        : data.error && data.error.message ? data.error.message : JSON.stringify(data.detail || data);
      if (resp.status === 401 || resp.status === 403) result("Admin token rejected: " + detail, false);
      else if (resp.status === 404 || resp.status === 405) result(`${method} ${path} is not available on this gateway (${resp.status}).`, false);
      else result(`${method} ${path} failed (${resp.status}): ${detail}`, false);
    } catch (err) {
      result(`${method} ${path} failed: ${err.message}`, false);
    } finally {
      buttons.forEach((b) => { b.disabled = false; });
    }
  }
  function wireAdmin() {
    showTokenState();
    $("token-form").addEventListener("submit", (ev) => {
      ev.preventDefault();
      const value = $("admin-token").value.trim();
      if (value) sessionStorage.setItem(TOKEN_KEY, value);
      $("admin-token").value = "";
      showTokenState();
    });
    $("token-clear").addEventListener("click", () => { sessionStorage.removeItem(TOKEN_KEY); showTokenState(); });
    $("pool-form").addEventListener("submit", (ev) => {
      ev.preventDefault();
      const gpus = Number($("pool-gpus").value), tp = Number($("pool-tp").value);
      admin("PUT", "/admin/pool", { gpus, tp }, () => `Pool resize to ${gpus} GPUs (new instances TP${tp}) requested.`);
    });
    $("policy-form").addEventListener("submit", (ev) => {
      ev.preventDefault();
      const policy = $("policy-name").value.trim();
      if (!policy) { result("Name a policy first.", false); return; }
      admin("PUT", "/admin/policy", { policy }, () => `Policy switched to ${policy}.`);
    });
    $("pause-btn").addEventListener("click", () => admin("POST", "/admin/pause", null, () => "Paused: new calls wait in the gateway."));
    $("resume-btn").addEventListener("click", () => admin("POST", "/admin/resume", null, () => "Resumed."));
    $("weights-form").addEventListener("submit", (ev) => {
      ev.preventDefault();
      const version = $("weights-value").value.trim();
      if (!version) { result("Enter a weight version first.", false); return; }
      admin("PUT", "/admin/weight-version", { version }, (d) => `Weight version ${d.previous} → ${d.version}.`);
    });
  }

  // ---------- trajectory detail ----------
  async function openTrajectory(id) {
    const dialog = $("traj-dialog");
    setText("traj-title", "Trajectory " + id);
    $("traj-open").href = "/view/trajectories/" + encodeURIComponent(id);
    $("traj-calls").tBodies[0].replaceChildren();
    $("traj-text").replaceChildren();
    setText("traj-note", "Loading…");
    if (!dialog.open) dialog.showModal();
    let data;
    try {
      // Text is asked for only with a token; the gateway refuses it to anyone else.
      const query = token() ? "?include_text=true" : "";
      const resp = await fetch("/trajectories/" + encodeURIComponent(id) + query, { headers: authHeaders() });
      if (resp.status === 401 || resp.status === 403) {
        setText("traj-note", "Trajectories need the trainer or admin token on this gateway: enter it under Admin.");
        return;
      }
      if (!resp.ok) { setText("traj-note", `Could not load it (${resp.status}).`); return; }
      data = await resp.json();
    } catch (err) { setText("traj-note", "Could not load it: " + err.message); return; }
    const calls = data.calls || [];
    const hasText = calls.some((c) => "completion_text" in c);
    setText("traj-note", hasText ? "" : "Prompt and completion text are shown only with the admin token.");
    $("traj-calls").tBodies[0].replaceChildren(...calls.map((c) => {
      const tr = el("tr");
      const ms = (v) => v === null || v === undefined ? "–" : dur(v / 1000);
      tr.append(el("td", { class: "num" }, String(c.seq)), el("td", {}, c.backend_id || "–"),
        el("td", { class: "num" }, String(c.tp ?? "–")), el("td", {}, c.status),
        el("td", { class: "num" }, ms(c.queued_ms)), el("td", { class: "num" }, ms(c.ttft_ms)),
        el("td", { class: "num" }, ms(c.total_ms)), el("td", { class: "num" }, num(c.prompt_len)),
        el("td", { class: "num" }, num((c.completion_ids || []).length)));
      return tr;
    }));
    if (hasText) $("traj-text").replaceChildren(...calls.map(callText));
  }

  function callText(c) {
    const box = el("details");
    box.append(el("summary", {}, `#${c.seq} · ${c.backend_id || "–"} · ${num((c.completion_ids || []).length)} tokens`));
    const said = (c.request_messages || []).map((m) => {
      const content = typeof m.content === "string" ? m.content : JSON.stringify(m.content ?? m.tool_calls ?? m);
      return `${m.role || "prompt"}: ${content}`;
    }).join("\n");
    if (said) box.append(el("pre", { class: "prompt" }, said));
    box.append(el("pre", {}, c.completion_text || ""));
    return box;
  }

  // ---------- start ----------
  document.addEventListener("DOMContentLoaded", () => {
    wireAdmin();
    // the page's policy allows no form to be submitted (form-action 'none'): go there
    $("quick-search").addEventListener("submit", (ev) => {
      ev.preventDefault();
      const q = $("quick-q").value.trim();
      location.href = "/view/search" + (q ? "?q=" + encodeURIComponent(q) : "");
    });
    $("traj-close").addEventListener("click", () => $("traj-dialog").close());
    fetch("/status").then((r) => r.json()).then((s) => { if (!latest) render(s); }).catch(() => {});
    connect();
    let resizeTimer = null;
    window.addEventListener("resize", () => {
      clearTimeout(resizeTimer);
      resizeTimer = setTimeout(() => { if (latest) render(latest); }, 150);
    });
  });
})();
