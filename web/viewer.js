// rollout-gateway trajectory viewer: /view/trajectories/{id}, /view/groups/{id}, /view/search.
// Plain JavaScript, no dependencies. Data comes from the trajectory API with the tab's token
// (the status page's, kept in sessionStorage); text from the server is only ever set with
// textContent, never parsed as HTML. A sample of 100k tokens is drawn block by block as it
// scrolls into view, so the page never builds more than a few thousand token nodes at once.
"use strict";

(() => {
  const TOKEN_KEY = "rollout-gateway.admin-token";  // shared with the status page
  const BLOCK = 768;  // tokens drawn per block at most
  const ROUTES_WINDOW = 512;  // positions of routed experts fetched per hover window
  const SEARCH_PAGE = 50;
  const $ = (id) => document.getElementById(id);
  const enc = encodeURIComponent;

  // ---------- small helpers ----------
  const { el, svg, num, dur, niceStep } = window.RG;
  function link(href, text) { return el("a", { href }, text); }
  function signed(n) { return n === null || n === undefined ? "–" : (n > 0 ? "+" : "") + n.toFixed(3); }
  const ms = (v) => (v === null || v === undefined ? "–" : dur(v / 1000));
  function when(iso) { return iso ? new Date(iso).toLocaleString("en-GB", { hour12: false }) : "–"; }
  function fact(label, value) {
    const d = el("div");
    d.append(el("dt", {}, label));
    const dd = el("dd");
    if (value instanceof Node) dd.append(value); else dd.textContent = value;
    d.append(dd);
    return d;
  }
  function note(text, bad = false) {
    const n = $("view-note");
    n.textContent = text || "";
    n.className = "note" + (bad ? " bad" : "");
  }
  function lowerBound(arr, x, key) {  // first index whose key >= x
    let lo = 0, hi = arr.length;
    while (lo < hi) { const mid = (lo + hi) >> 1; if (key(arr[mid]) < x) lo = mid + 1; else hi = mid; }
    return lo;
  }

  // ---------- credentials ----------
  function token() { return sessionStorage.getItem(TOKEN_KEY) || ""; }
  function showTokenState() { $("token-state").textContent = token() ? "token set for this tab" : "no token"; }
  async function getJSON(path) {
    const headers = token() ? { Authorization: "Bearer " + token() } : {};
    try {
      const resp = await fetch(path, { headers });
      const data = await resp.json().catch(() => null);
      if (resp.ok) return { ok: true, data };
      const msg = data && (typeof data.detail === "string" ? data.detail
        : data.error && data.error.message ? data.error.message : JSON.stringify(data));
      return { ok: false, status: resp.status, message: msg || resp.statusText };
    } catch (err) { return { ok: false, status: 0, message: err.message }; }
  }
  function refused(r) {
    if (r.status === 401) note("This gateway needs the trainer or admin token to show trajectories: enter it above.", true);
    else if (r.status === 403) note("This credential cannot read trajectories: it needs the trainer or admin token (" + r.message + ").", true);
    else if (r.status === 404) note(r.message || "Not found.", true);
    else note(`Could not load it (${r.status || "network"}): ${r.message}`, true);
  }

  // ---------- trajectory ----------
  const state = { view: null, blocks: [], observer: null, routes: new Map(), tips: null };

  async function showTrajectory(id) {
    document.title = `${id} · rollout-gateway viewer`;
    note("Loading…");
    const r = await getJSON(`/trajectories/${enc(id)}/view${location.search}`);
    if (!r.ok) { $("traj-view").hidden = true; refused(r); return; }
    note("");
    const v = r.data;
    state.view = v;
    state.routes = new Map();
    $("traj-view").hidden = false;
    renderHead(v);
    renderTree(v);
    renderTimeline(v);
    // a frame between the parts: no one task holds the page for all of a long trajectory
    await frame();
    renderCalls(v);
    await frame();
    renderTokens(v);
    await frame();
    renderMessages(v);
  }
  function frame() { return new Promise((r) => requestAnimationFrame(() => setTimeout(r, 0))); }

  function selectedBranch(v) { return v.tokens ? v.tokens.branch : null; }

  function renderHead(v) {
    $("traj-id").textContent = "Trajectory " + v.id;
    const attempts = $("traj-attempts");
    attempts.replaceChildren();
    if (v.attempts.length > 1) {
      attempts.append("attempt ");
      for (const a of v.attempts) {
        if (a === v.attempt) attempts.append(el("b", {}, String(a)));
        else attempts.append(link(`?attempt=${a}`, String(a)));
        attempts.append(" ");
      }
    }
    const main = v.branches.find((b) => b.main);
    const versions = [...new Set(v.calls.map((c) => c.weight_version))];
    const stale = Math.max(...v.branches.map((b) => b.max_staleness ?? 0), 0);
    const st = v.live && v.live.phase !== "finished" ? v.live.phase : v.finished_at ? "finished" : "unfinished";
    const facts = [
      fact("Group", v.group_id ? link(`/view/groups/${enc(v.group_id)}`, v.group_id) : "–"),
      fact("State", st), fact("Reward", v.reward === null ? "–" : String(v.reward)),
      fact("Calls", num(v.calls.length)), fact("Branches", num(v.branches.length)),
      fact("Main sample", main ? `${num(main.length)} tokens` : "–"),
      fact("Trained (main)", main ? num(main.trained) : "–"),
      fact("Weight versions", versions.join(", ") || "–"),
      fact("Staleness", `${stale} (current ${v.current_version})`),
      fact("Policies", v.models.join(", ") || "–"),
      fact("Created", when(v.created_at)),
    ];
    $("traj-facts").replaceChildren(...facts);
  }

  function branchPath(v, branch) {
    const p = new URLSearchParams(location.search);
    p.set("branch", String(branch));
    return `?${p}`;
  }

  function renderTree(v) {
    const byParent = new Map();
    const ids = new Set(v.branches.map((b) => b.branch));
    for (const b of v.branches) {
      const key = b.parent_branch !== null && ids.has(b.parent_branch) ? b.parent_branch : "root";
      if (!byParent.has(key)) byParent.set(key, []);
      byParent.get(key).push(b);
    }
    const chosen = selectedBranch(v);
    const build = (key) => {
      const ul = el("ul");
      for (const b of byParent.get(key) || []) {
        const li = el("li");
        const btn = el("button", { type: "button", class: "branch" + (b.branch === chosen ? " selected" : ""),
          "data-branch": String(b.branch) });
        const what = el("span", { class: "what" }, `branch ${b.branch} · ${b.kind}`);
        if (b.main) what.append(el("span", { class: "badge main" }, "main"));
        if (b.kind === "side call") what.append(el("span", { class: "badge side" }, "side"));
        btn.append(what,
          el("span", { class: "counts" }, `${b.calls.length} calls · ${num(b.length)} tokens · ${num(b.trained)} trained`),
          el("span", { class: "why" }, b.reason + (b.opened_by !== null ? ` (call #${b.opened_by})` : "")));
        btn.addEventListener("click", () => {
          history.replaceState(null, "", branchPath(v, b.branch));
          showTrajectory(v.id);
        });
        li.append(btn);
        if (byParent.has(b.branch)) li.append(build(b.branch));
        ul.append(li);
      }
      return ul;
    };
    $("branch-tree").replaceChildren(...build("root").children);
  }

  function renderTimeline(v) {
    const host = $("call-timeline");
    const calls = v.calls;
    if (!calls.length) { host.replaceChildren(); return; }
    const rows = [...new Set(calls.map((c) => c.branch))].sort((a, b) => a - b);
    const t0 = Math.min(...calls.map((c) => c.started_at - (c.tool_gap_ms || 0) / 1000));
    const t1 = Math.max(...calls.map((c) => c.started_at + c.total_ms / 1000));
    const width = Math.max(320, host.clientWidth || 640), rowH = 20, m = { l: 70, r: 10, t: 4, b: 20 };
    const height = m.t + rows.length * rowH + m.b;
    const root = svg("svg", { viewBox: `0 0 ${width} ${height}`, height, role: "img", "aria-label": "calls over time" });
    const span = Math.max(t1 - t0, 1e-3);
    const x = (t) => m.l + (width - m.l - m.r) * ((t - t0) / span);
    const step = niceStep(span, Math.max(2, Math.floor((width - m.l) / 90)));
    for (let t = 0; t <= span + 1e-9; t += step) {
      root.append(svg("line", { class: "gridline", x1: x(t0 + t), x2: x(t0 + t), y1: m.t, y2: height - m.b }),
        svg("text", { x: x(t0 + t), y: height - 6, "text-anchor": "middle" }, dur(t).replace(" ", "")));
    }
    rows.forEach((b, i) => root.append(svg("text", { class: "row-label", x: 0, y: m.t + i * rowH + 14 }, `branch ${b}`)));
    const chosen = selectedBranch(v);
    for (const c of calls) {
      const y = m.t + rows.indexOf(c.branch) * rowH + 4, h = rowH - 8;
      const g = svg("g", { class: "row", "data-seq": c.seq, opacity: c.branch === chosen || chosen === null ? 1 : 0.45 });
      g.append(svg("title", {}, `call #${c.seq} (branch ${c.branch}): queued ${ms(c.queued_ms)}, LLM ${ms(c.llm_ms)}` +
        (c.tool_gap_ms !== null ? `, after a tool gap of ${ms(c.tool_gap_ms)}` : "")));
      if (c.tool_gap_ms) {
        g.append(svg("rect", { class: "seg-tool", x: x(c.started_at - c.tool_gap_ms / 1000), y: y + 3, height: h - 6,
          width: Math.max(1, x(c.started_at) - x(c.started_at - c.tool_gap_ms / 1000)) }));
      }
      const q = c.started_at + c.queued_ms / 1000;
      g.append(svg("rect", { class: "seg-queue", x: x(c.started_at), y, height: h, width: Math.max(0.5, x(q) - x(c.started_at)) }),
        svg("rect", { class: "seg-llm", x: x(q), y, height: h, width: Math.max(1, x(c.started_at + c.total_ms / 1000) - x(q)) }));
      g.addEventListener("click", () => jumpToCall(c.seq));
      root.append(g);
    }
    host.replaceChildren(root);
  }
  function renderCalls(v) {
    const onPath = new Set(v.tokens ? v.tokens.calls.map((c) => c[0]) : []);
    $("calls-note").textContent = v.tokens ? `highlighted: the calls of branch ${v.tokens.branch}'s sample` : "";
    $("calls-table").tBodies[0].replaceChildren(...v.calls.map((c) => {
      const tr = el("tr", { id: `call-${c.seq}`, class: onPath.has(c.seq) ? "selected" : "other" });
      tr.append(el("td", { class: "num" }, String(c.seq)), el("td", { class: "num" }, String(c.branch)),
        el("td", {}, c.model + (c.requested_model ? ` (asked ${c.requested_model})` : "")),
        el("td", {}, c.backend_id || "–"), el("td", { class: "num" }, String(c.tp ?? "–")),
        el("td", {}, c.weight_version + (c.weight_segments ? " (" + c.weight_segments.map((s) => s[2]).join("→") + ")" : "")),
        el("td", { class: "num" }, ms(c.queued_ms)), el("td", { class: "num" }, ms(c.llm_ms)),
        el("td", { class: "num" }, ms(c.tool_gap_ms)), el("td", { class: "num" }, num(c.prompt_len)),
        el("td", { class: "num" }, num(c.completion_len)),
        el("td", {}, c.status === "ok" ? (c.finish_reason || "–") : `${c.status}: ${c.error || ""}`),
        el("td", {}, c.kept_len !== null ? `${num(c.kept_len)} from the record` : ""));
      return tr;
    }));
  }

  // ----- tokens -----
  function segmentsOf(tk, v) {
    const n = tk.token_ids.length, segs = [];
    const branch = v.branches.find((b) => b.branch === tk.branch);
    const first = tk.calls.length ? tk.calls[0][1] : n;
    const version = (i) => { const k = lowerBound(tk.versions, i + 1, (r) => r[1]); return k < tk.versions.length && tk.versions[k][0] <= i ? tk.versions[k][2] : null; };
    if (first > 0) segs.push({ start: 0, end: first, kind: "prompt", label: `from branch ${branch ? branch.parent_branch : "–"} (${num(first)} tokens shared)` });
    for (const [seq, ps, cs, ce] of tk.calls) {
      if (cs > ps) segs.push({ start: ps, end: cs, kind: "prompt", seq, label: `call #${seq} · prompt · ${num(cs - ps)} new tokens` });
      segs.push({ start: cs, end: ce, kind: "completion", seq,
        label: `call #${seq} · generated · ${num(ce - cs)} tokens` + (ce > cs ? ` · version ${version(cs)}` : "") });
    }
    const out = [];
    for (const s of segs) {
      for (let a = s.start; a < s.end || (a === s.start && s.end === s.start); a += BLOCK) {
        out.push({ ...s, start: a, end: Math.min(s.end, a + BLOCK), label: a === s.start ? s.label : s.label + " (continued)" });
        if (s.end === s.start) break;
      }
    }
    return out;
  }

  function tokenFlags(tk) {
    const n = tk.token_ids.length;
    const ti = new Uint8Array(n), vb = new Map(), mm = new Set(tk.mismatches.map((m) => m[1]));
    for (const [a, b] of tk.token_in) ti.fill(1, a, b);
    let prev = null;
    for (const [a, , ver] of tk.versions) { if (prev !== null && ver !== prev) vb.set(a, ver); prev = ver; }
    return { ti, vb, mm };
  }

  function heat(lp) {
    const p = Math.exp(lp);
    return p >= 0.9 ? 0 : p >= 0.7 ? 1 : p >= 0.5 ? 2 : p >= 0.3 ? 3 : p >= 0.1 ? 4 : p >= 0.01 ? 5 : 6;
  }
  const SPECIAL = /^<\|[^|]*\|>$|^<\/?tool_call>$|^<\/?think>$/;
  function pieceOf(tk, i) {
    if (!tk.pieces || $("show-ids").checked) return null;
    const p = tk.pieces[tk.token_ids[i]];
    return p === undefined ? null : p;
  }

  function fillBlock(block) {
    const v = state.view, tk = v.tokens, f = state.flags;
    const { start, end } = block.seg;
    const frag = document.createDocumentFragment();
    for (let i = start; i < end; i++) {
      if (f.vb.has(i)) frag.append(el("span", { class: "vb", title: "weight version " + f.vb.get(i) }, "v" + f.vb.get(i)));
      if (f.mm.has(i)) frag.append(el("span", { class: "mm", title: "the harness's tokens left the record here" }, "!"));
      const lp = tk.logprobs[i];
      let cls = "t " + (tk.loss_mask[i] ? "tr" : lp !== null ? "gen" : "ctx");
      if (lp !== null) cls += " h" + heat(lp);
      if (f.ti[i]) cls += " ti";
      const piece = pieceOf(tk, i);
      if (piece !== null && SPECIAL.test(piece)) cls += " sp";
      const span = document.createElement("span");
      span.className = cls;
      span.dataset.i = String(i);
      span.textContent = piece === null ? String(tk.token_ids[i]) : piece.replace(/\n/g, "↵\n");
      frag.append(span);
    }
    block.body.append(frag);
    block.node.style.minHeight = "";
    block.filled = true;
  }

  function renderTokens(v) {
    const host = $("tokens");
    if (state.observer) state.observer.disconnect();
    const tk = v.tokens;
    if (!tk) {
      $("tokens-title").textContent = "Sample";
      $("tokens-summary").textContent = "no successful call: nothing to train on";
      host.replaceChildren();
      return;
    }
    const b = v.branches.find((x) => x.branch === tk.branch);
    $("tokens-title").textContent = `Sample of branch ${tk.branch}` + (tk.main ? " (main)" : "");
    $("tokens-summary").textContent = `${num(tk.token_ids.length)} tokens · ${num(b ? b.trained : 0)} trained` +
      (tk.has_routes ? " · routed experts on hover" : "");
    $("pieces-note").textContent = !v.text ? "text needs the admin token: ids are shown" : tk.pieces_note || "";
    $("show-ids").disabled = !tk.pieces;
    host.classList.toggle("ids", !tk.pieces || $("show-ids").checked);
    host.classList.toggle("heat", $("show-heat").checked);
    state.flags = tokenFlags(tk);
    const perLine = Math.max(20, Math.floor((host.clientWidth || 900) / 7.8));
    state.blocks = segmentsOf(tk, v).map((seg) => {
      const node = el("div", { class: "seg", "data-start": String(seg.start), "data-seq": String(seg.seq ?? "") });
      const head = el("span", { class: "seg-head " + seg.kind }, seg.label);
      const body = el("span", { class: "seg-body" });
      node.append(head, body);
      let chars = 0;
      for (let i = seg.start; i < seg.end; i++) { const p = pieceOf(tk, i); chars += p === null ? 8 : p.length; }
      node.style.minHeight = (30 + 22 * Math.ceil(chars / perLine)) + "px";
      return { seg, node, body, filled: false };
    });
    host.replaceChildren(...state.blocks.map((x) => x.node));
    if ($("draw-all").checked) {  // every block now, in one go: what find in page needs
      for (const x of state.blocks) fillBlock(x);
      return;
    }
    const byNode = new Map(state.blocks.map((x) => [x.node, x]));
    state.observer = new IntersectionObserver((entries) => {
      for (const e of entries) {
        const block = byNode.get(e.target);
        if (e.isIntersecting && block && !block.filled) fillBlock(block);
      }
    }, { root: host, rootMargin: "600px 0px" });
    for (const x of state.blocks) state.observer.observe(x.node);
  }

  function jumpToCall(seq) {
    const block = state.blocks.find((x) => x.seg.seq === seq);
    if (block) block.node.scrollIntoView({ block: "start" });
    const row = $(`call-${seq}`);
    if (row) row.scrollIntoView({ block: "nearest" });
  }

  // ----- hover: one token's facts, and its routed experts when recorded -----
  async function routesAt(i) {
    const v = state.view, tk = v.tokens;
    const start = Math.floor(i / ROUTES_WINDOW) * ROUTES_WINDOW;
    if (!state.routes.has(start)) {
      const p = new URLSearchParams({ branch: String(tk.branch), attempt: String(v.attempt), start: String(start), end: String(start + ROUTES_WINDOW) });
      const model = new URLSearchParams(location.search).get("model");
      if (model) p.set("model", model);  // a policy's sample: its routes
      state.routes.set(start, getJSON(`/trajectories/${enc(v.id)}/routes?${p}`));
    }
    const r = await state.routes.get(start);
    if (!r.ok) return "could not load: " + r.message;
    const row = r.data.rows[i - start];
    if (!row) return "–";
    if (row.every((layer) => layer.every((e) => e < 0))) return "not recorded for this position";
    const lines = row.slice(0, 12).map((layer, l) => `L${l}: ${layer.join(" ")}`);
    if (row.length > 12) lines.push(`… ${row.length - 12} more layers`);
    return lines.join("\n");
  }

  function showTip(span, ev) {
    const v = state.view, tk = v.tokens, i = Number(span.dataset.i);
    const lp = tk.logprobs[i];
    const k = lowerBound(tk.calls, i + 1, (c) => c[1]) - 1;
    const call = k >= 0 ? tk.calls[k] : null;
    const where = call === null ? "shared with the parent branch"
      : i >= call[2] ? `generated by call #${call[0]}` : `prompt of call #${call[0]}`;
    const ver = tk.versions[lowerBound(tk.versions, i + 1, (r) => r[1])];
    const rows = [["position", String(i)], ["id", String(tk.token_ids[i])]];
    if (tk.pieces && tk.pieces[tk.token_ids[i]] !== undefined) rows.push(["text", JSON.stringify(tk.pieces[tk.token_ids[i]])]);
    rows.push(["loss mask", tk.loss_mask[i] ? "1 (trained here)" : lp !== null ? "0 (trained in another branch's sample)" : "0 (context)"]);
    if (lp !== null) rows.push(["logprob", `${lp.toFixed(4)} (p ${Math.exp(lp).toFixed(3)})`]);
    if (lp !== null && ver && ver[0] <= i) rows.push(["weight version", ver[2]]);
    rows.push(["from", where]);
    if (state.flags.ti[i]) {
      const t = tk.token_in.find((s) => s[0] <= i && i < s[1]);
      rows.push(["token in", `call #${t[2]} ran this from the record (the harness re-rendered it)`]);
    }
    const tip = $("tip"), dl = el("dl");
    for (const [a, b] of rows) dl.append(el("dt", {}, a), el("dd", {}, b));
    tip.replaceChildren(dl);
    if (tk.has_routes) {
      const box = el("div", { class: "routes" }, "routed experts: loading…");
      tip.append(box);
      routesAt(i).then((text) => { if (tip.dataset.i === String(i)) box.textContent = "routed experts:\n" + text; });
    }
    tip.dataset.i = String(i);
    tip.hidden = false;
    const x = Math.min(ev.clientX + 14, window.innerWidth - tip.offsetWidth - 8);
    const y = ev.clientY + 16 + tip.offsetHeight > window.innerHeight ? ev.clientY - tip.offsetHeight - 10 : ev.clientY + 16;
    tip.style.left = Math.max(4, x) + "px";
    tip.style.top = Math.max(4, y) + "px";
  }

  // ----- messages (admin token) -----
  function messageText(m) {
    if (typeof m.content === "string") return m.content;
    if (m.prompt !== undefined) return typeof m.prompt === "string" ? m.prompt : JSON.stringify(m.prompt);
    const parts = [];
    if (Array.isArray(m.content)) for (const p of m.content) parts.push(typeof p.text === "string" ? p.text : JSON.stringify(p));
    else if (m.content !== undefined && m.content !== null) parts.push(JSON.stringify(m.content));
    if (m.tool_calls) parts.push(JSON.stringify(m.tool_calls, null, 1));
    return parts.join("\n");
  }
  function renderMessages(v) {
    $("messages-empty").hidden = v.text;
    if (!v.text) { $("messages").replaceChildren(); return; }
    $("messages").replaceChildren(...v.calls.map((c) => {
      const box = el("details", { "data-seq": String(c.seq) });
      box.append(el("summary", {}, `#${c.seq} · branch ${c.branch} · ${c.model} · ${(c.messages || []).length} new messages · ${num(c.completion_len)} tokens generated`));
      box.addEventListener("toggle", () => {
        if (!box.open || box.dataset.filled) return;
        box.dataset.filled = "1";
        for (const m of c.messages || []) {
          box.append(el("span", { class: "role" }, m.role || "prompt"), el("pre", {}, messageText(m)));
        }
        box.append(el("span", { class: "role" }, "reply"), el("pre", {}, c.completion_text || ""));
      });
      return box;
    }));
  }

  // ---------- group ----------
  async function showGroup(id) {
    document.title = `group ${id} · rollout-gateway viewer`;
    note("Loading…");
    const r = await getJSON(`/groups/${enc(id)}/view${location.search}`);
    if (!r.ok) { refused(r); return; }
    note("");
    const g = r.data;
    $("group-view").hidden = false;
    $("group-id").textContent = "Group " + g.group_id;
    const finished = g.members.filter((m) => m.finished).length;
    $("group-summary").textContent = `${g.members.length} trajectories · ${finished} finished · reward ` +
      (g.reward_mean === null ? "–" : `${g.reward_mean.toFixed(3)} ± ${g.reward_std.toFixed(3)}`) +
      ` · current version ${g.current_version}`;
    const maxR = Math.max(1e-9, ...g.members.map((m) => Math.abs(m.reward ?? 0)));
    const maxL = Math.max(1, ...g.members.map((m) => m.length));
    const bar = (frac, cls) => {
      const b = el("span", { class: "hbar " + cls });
      b.style.width = Math.max(0, Math.min(100, 100 * frac)) + "%";
      return b;
    };
    $("group-table").tBodies[0].replaceChildren(...g.members.map((m) => {
      const tr = el("tr");
      const idCell = el("td", { class: "id-cell" });
      idCell.append(link(`/view/trajectories/${enc(m.id)}`, m.id));
      const rb = el("td", { class: "bar-cell" }), lb = el("td", { class: "bar-cell" });
      if (m.reward !== null) rb.append(bar(Math.abs(m.reward) / maxR, m.reward < 0 ? "neg" : ""));
      lb.append(bar(m.length / maxL, "len"));
      const adv = el("td", { class: "num " + (m.advantage > 0 ? "pos" : m.advantage < 0 ? "neg-text" : "") }, signed(m.advantage));
      tr.append(idCell, el("td", {}, m.phase && m.phase !== "finished" ? m.phase : m.finished ? "finished" : "unfinished"),
        el("td", { class: "num" }, m.reward === null ? "–" : String(m.reward)), rb, adv,
        el("td", { class: "num" }, signed(m.advantage_unscaled)), el("td", { class: "num" }, num(m.length)), lb,
        el("td", { class: "num" }, num(m.trained)), el("td", { class: "num" }, num(m.generated)),
        el("td", { class: "num" }, num(m.calls)), el("td", { class: "num" }, num(m.branches)),
        el("td", {}, m.versions.join(", ") || "–"), el("td", { class: "num" }, m.max_staleness === null ? "–" : String(m.max_staleness)));
      return tr;
    }));
  }

  // ---------- search ----------
  const FIELDS = ["q", "group_id", "finished", "min_reward", "max_reward", "min_tokens", "max_tokens", "weight_version", "model", "order"];
  function searchParams() {
    const p = new URLSearchParams(location.search), out = new URLSearchParams();
    for (const k of FIELDS) if (p.get(k)) out.set(k, p.get(k));
    if (!out.get("order")) out.set("order", "-created");
    out.set("offset", String(Math.max(0, Number(p.get("offset")) || 0)));
    return out;
  }
  async function showSearch() {
    $("search-view").hidden = false;
    const p = searchParams(), form = $("search-form");
    for (const k of FIELDS) if (form.elements[k]) form.elements[k].value = p.get(k) || (k === "order" ? "-created" : "");
    note("Searching…");
    const r = await getJSON(`/trajectories?${p}&limit=${SEARCH_PAGE}`);
    if (!r.ok) { $("search-table").tBodies[0].replaceChildren(); refused(r); return; }
    note("");
    const rows = r.data.data, offset = Number(p.get("offset"));
    $("search-summary").textContent = rows.length ? `${offset + 1}–${offset + rows.length}` : "no trajectory matches";
    $("search-table").tBodies[0].replaceChildren(...rows.map((t) => {
      const tr = el("tr"), id = el("td", { class: "id-cell" }), grp = el("td");
      id.append(link(`/view/trajectories/${enc(t.id)}`, t.id));
      if (t.group_id) grp.append(link(`/view/groups/${enc(t.group_id)}`, t.group_id)); else grp.textContent = "–";
      const st = t.live && t.live.phase !== "finished" ? t.live.phase : t.finished_at ? "finished" : "unfinished";
      tr.append(id, grp, el("td", {}, st), el("td", { class: "num" }, t.reward === null ? "–" : String(t.reward)),
        el("td", { class: "num" }, num(t.calls)), el("td", { class: "num" }, num(t.completion_tokens)),
        el("td", {}, when(t.created_at)));
      return tr;
    }));
    const go = (off) => { p.set("offset", String(off)); location.search = p.toString(); };
    $("page-prev").disabled = offset <= 0;
    $("page-next").disabled = rows.length < SEARCH_PAGE;
    $("page-prev").onclick = () => go(Math.max(0, offset - SEARCH_PAGE));
    $("page-next").onclick = () => go(offset + SEARCH_PAGE);
  }
  function wireSearch() {
    $("search-form").addEventListener("submit", (ev) => {
      ev.preventDefault();
      const form = ev.target, p = new URLSearchParams();
      for (const k of FIELDS) { const val = form.elements[k] && form.elements[k].value.trim(); if (val) p.set(k, val); }
      location.href = `/view/search?${p}`;
    });
  }

  // ---------- start ----------
  function route() {
    const parts = location.pathname.split("/").filter(Boolean);
    if (parts[1] === "trajectories" && parts[2]) return showTrajectory(decodeURIComponent(parts[2]));
    if (parts[1] === "groups" && parts[2]) return showGroup(decodeURIComponent(parts[2]));
    return showSearch();
  }
  document.addEventListener("DOMContentLoaded", () => {
    showTokenState();
    $("token-form").addEventListener("submit", (ev) => {
      ev.preventDefault();
      const value = $("view-token").value.trim();
      if (value) sessionStorage.setItem(TOKEN_KEY, value);
      $("view-token").value = "";
      showTokenState();
      route();
    });
    $("token-clear").addEventListener("click", () => { sessionStorage.removeItem(TOKEN_KEY); showTokenState(); route(); });
    $("show-ids").addEventListener("change", () => { if (state.view) renderTokens(state.view); });
    $("show-heat").addEventListener("change", () => $("tokens").classList.toggle("heat", $("show-heat").checked));
    $("draw-all").checked = new URLSearchParams(location.search).get("render") === "all";
    $("draw-all").addEventListener("change", () => { if (state.view) renderTokens(state.view); });
    const host = $("tokens");
    host.addEventListener("mouseover", (ev) => {
      const span = ev.target.closest && ev.target.closest(".t");
      if (span && span.dataset.i !== undefined) showTip(span, ev);
    });
    host.addEventListener("mouseleave", () => { $("tip").hidden = true; });
    host.addEventListener("scroll", () => { $("tip").hidden = true; }, { passive: true });
    wireSearch();
    $("quick-search").addEventListener("submit", (ev) => {  // no form is submitted (CSP)
      ev.preventDefault();
      const q = $("quick-q").value.trim();
      location.href = "/view/search" + (q ? "?q=" + enc(q) : "");
    });
    route();
  });
})();
