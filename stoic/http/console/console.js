// stoic console: reads /console/stream (one JSON snapshot a second, server-sent events read with
// fetch so that the key travels in the Authorization header, never in the URL), renders it, and
// arms faults through /admin/faults. No dependencies; charts are drawn on <canvas>.
"use strict";

const $ = (id) => document.getElementById(id);
const STORE = "stoic-console-key";
let controller = null;
let retry = null;

function key() {
  return sessionStorage.getItem(STORE) || "";
}

function authHeaders() {
  const k = key();
  return k ? { Authorization: "Bearer " + k } : {};
}

function say(text, isError) {
  const el = $("connection");
  el.textContent = text;
  el.classList.toggle("error", Boolean(isError));
}

async function errorMessage(resp) {
  try {
    const body = await resp.json();
    return (body.error && body.error.message) || resp.statusText;
  } catch (e) {
    return resp.statusText;
  }
}

async function connect() {
  if (controller) controller.abort();
  clearTimeout(retry);
  controller = new AbortController();
  const signal = controller.signal;
  say("connecting…");
  let resp;
  try {
    resp = await fetch("console/stream", { headers: authHeaders(), signal, cache: "no-store" });
  } catch (e) {
    if (!signal.aborted) later("the server cannot be reached");
    return;
  }
  if (!resp.ok) {
    clearData();
    const message = await errorMessage(resp);
    say("not authorised (" + resp.status + "): " + message, true);
    return; // a wrong key is not retried: enter another one
  }
  say("live: one update a second");
  const reader = resp.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  try {
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, { stream: true });
      let cut;
      while ((cut = buffer.indexOf("\n\n")) >= 0) {
        const event = buffer.slice(0, cut);
        buffer = buffer.slice(cut + 2);
        for (const line of event.split("\n")) {
          if (line.startsWith("data: ")) render(JSON.parse(line.slice(6)));
        }
      }
    }
  } catch (e) {
    if (signal.aborted) return;
  }
  if (!signal.aborted) later("the stream ended (server restarting or stopping?)");
}

function later(why) {
  say(why + "; reconnecting in 2 s", true);
  retry = setTimeout(connect, 2000);
}

// -- rendering ------------------------------------------------------------------------------
function text(id, value) {
  $(id).textContent = value === null || value === undefined ? "—" : String(value);
}

function stateWord(el, word) {
  el.textContent = word;
  el.className = "state state-" + word.replace(/\s+/g, "-");
}

function seconds(s) {
  if (s === null || s === undefined) return "—";
  return s < 10 ? s.toFixed(2) + " s" : s.toFixed(1) + " s";
}

function percent(x) {
  return x === null || x === undefined ? "—" : (100 * x).toFixed(1) + " %";
}

function fill(tbody, rows, empty) {
  tbody.replaceChildren();
  if (!rows.length) {
    const tr = tbody.insertRow();
    const td = tr.insertCell();
    td.colSpan = tbody.parentElement.tHead.rows[0].cells.length;
    td.textContent = empty;
    td.className = "muted";
    return;
  }
  for (const cells of rows) {
    const tr = tbody.insertRow();
    for (const cell of cells) {
      const td = tr.insertCell();
      if (cell instanceof Node) td.append(cell);
      else td.textContent = cell;
    }
  }
}

function badge(word) {
  const span = document.createElement("span");
  stateWord(span, word);
  return span;
}

function render(s) {
  text("model", s.model);
  const ex = s.executor;
  stateWord($("state"), ex.state);
  text("reason", ex.reason || "");
  text("pid", ex.pid);
  text("incarnation", ex.incarnation);
  text("restarts", ex.restarts);
  const kinds = Object.entries(ex.restarts_by_kind).map(([k, n]) => k + ": " + n);
  text("restarts-by-kind", kinds.length ? kinds.join(", ") : "none");
  text("mode", ex.mode);
  text("spares", ex.spares);

  const w = s.work;
  text("running-count", w.running_count);
  text("waiting-count", w.waiting_count);
  text("kv", w.kv_blocks_used + " / " + w.kv_blocks_total + " (" + w.kv_blocks_cached + " cached)");
  $("kv-meter").value = w.kv_blocks_total ? w.kv_blocks_used / w.kv_blocks_total : 0;
  text(
    "budget",
    w.token_budget + " tokens" + (w.backed_off ? " — BACKED OFF from " + w.token_budget_configured + " after out of memory" : " (as configured)")
  );
  text("prefix", percent(w.prefix_hit_rate));
  text("generated", w.generated_tokens);
  text(
    "drafts",
    w.spec_draft_tokens
      ? w.spec_accepted_tokens + " of " + w.spec_draft_tokens + " (" + percent(w.spec_accepted_tokens / w.spec_draft_tokens) + ")"
      : "none (--speculative)"
  );
  text("steps", w.steps);
  const seqs = w.running === null ? null : [...w.running, ...w.waiting];
  fill(
    $("sequences").tBodies[0],
    (seqs || []).map((q) => [q.request_id, q.status, q.generated + " / " + q.max_tokens, seconds(q.age)]),
    seqs === null ? "per-sequence view not available (see the replicas)" : "no sequence in the engine"
  );

  const points = s.series;
  const last = points.length ? points[points.length - 1] : {};
  text("now-tps", last.tokens_per_s);
  text("now-ttft", triple(last, "ttft"));
  text("now-itl", triple(last, "itl"));
  chart($("chart-tps"), points, [["tokens_per_s", []]]);
  chart($("chart-ttft"), points, percentiles("ttft"));
  chart($("chart-itl"), points, percentiles("itl"));

  fill(
    $("incidents").tBodies[0],
    (s.incidents || []).map((i) => [
      new Date(i.at * 1000).toLocaleTimeString(),
      i.kind,
      badge(i.state),
      seconds(i.recovered_after),
      streams(i),
      i.error,
    ]),
    s.incidents === null ? "incidents are not available here" : "no failure so far"
  );
  for (const td of $("incidents").querySelectorAll("tbody td:last-child")) td.className = "error";

  $("replicas-section").hidden = s.replicas === null;
  if (s.replicas !== null) {
    $("routing").textContent = s.routing || "—";
    fill(
      $("replicas").tBodies[0],
      s.replicas.map((r) => [r.replica, badge(r.state), r.pid, r.running, r.waiting, percent(r.kv_cache_usage), r.restarts, r.generated_tokens, percent(r.prefix_hit_rate)]),
      "no replica has reported yet"
    );
  }

  const tenants = s.tenants || [];
  $("tenants-section").hidden = tenants.length === 0;
  fill(
    $("tenants").tBodies[0],
    tenants.map((t) => [t.tenant === "" ? "(default)" : t.tenant, t.weight, t.running, t.waiting, t.admitted, t.refused, t.timed_out, t.computed_tokens]),
    "no tenant yet"
  );

  const faults = s.faults;
  $("faults-section").hidden = faults.kinds.length === 0;
  text("faults-injected", faults.injected);
  const buttons = $("fault-buttons");
  if (buttons.dataset.kinds !== faults.kinds.join(",")) {
    buttons.dataset.kinds = faults.kinds.join(",");
    buttons.replaceChildren(
      ...faults.kinds.map((kind) => {
        const b = document.createElement("button");
        b.type = "button";
        b.dataset.kind = kind;
        b.textContent = "Arm " + kind;
        b.addEventListener("click", () => arm(kind));
        return b;
      })
    );
  }
}

function streams(i) {
  const parts = [];
  if (i.resumed) parts.push(i.resumed + " resumed");
  if (i.failed) parts.push(i.failed + " failed with partial output");
  if (i.isolated) parts.push(i.isolated + " isolated");
  if (i.exhausted) parts.push(i.exhausted + " out of resumes");
  if (i.resumed) {
    parts.push(
      (i.kv_kept ? "KV cache kept: " + i.reused_tokens + " tokens reused, " : "KV cache dropped: ") +
        i.recompute_tokens + " recomputed"
    );
  }
  return parts.length ? parts.join(", ") : "none in flight";
}

function triple(p, name) {
  const v = ["p50", "p90", "p99"].map((q) => p[name + "_" + q]);
  if (v.every((x) => x === null || x === undefined)) return "no tokens in the last minute";
  return "p50 " + v[0] + ", p90 " + v[1] + ", p99 " + v[2];
}

function percentiles(name) {
  return [
    [name + "_p50", []],
    [name + "_p90", [6, 4]],
    [name + "_p99", [2, 3]],
  ];
}

function clearData() {
  for (const id of ["model", "pid", "incarnation", "restarts", "restarts-by-kind", "mode", "spares", "running-count", "waiting-count", "kv", "budget", "prefix", "generated", "drafts", "steps", "now-tps", "now-ttft", "now-itl", "faults-injected"]) {
    text(id, null);
  }
  stateWord($("state"), "unknown");
  text("reason", "");
  for (const t of ["sequences", "incidents", "replicas", "tenants"]) $(t).tBodies[0].replaceChildren();
  $("faults-section").hidden = true;
  $("replicas-section").hidden = true;
  $("tenants-section").hidden = true;
}

// -- charts ---------------------------------------------------------------------------------
function chart(canvas, points, series) {
  const ratio = window.devicePixelRatio || 1;
  const width = canvas.clientWidth || 300;
  const height = canvas.clientHeight || 160;
  canvas.width = Math.round(width * ratio);
  canvas.height = Math.round(height * ratio);
  const g = canvas.getContext("2d");
  g.setTransform(ratio, 0, 0, ratio, 0, 0);
  g.clearRect(0, 0, width, height);
  const left = 44, right = 8, top = 8, bottom = 20;
  let max = 0;
  for (const p of points) for (const [name] of series) if (p[name] > max) max = p[name];
  max = max > 0 ? niceCeil(max) : 1;
  g.font = "11px system-ui, sans-serif";
  g.fillStyle = "#333";
  g.strokeStyle = "#c8c8c8";
  g.lineWidth = 1;
  for (const frac of [0, 0.5, 1]) {
    const y = top + (height - top - bottom) * (1 - frac);
    g.beginPath();
    g.moveTo(left, y);
    g.lineTo(width - right, y);
    g.stroke();
    g.fillText(String(+(max * frac).toPrecision(3)), 2, y + 4);
  }
  g.fillText("−5 min", left, height - 5);
  g.fillText("now", width - right - 22, height - 5);
  const span = 300;
  const now = points.length ? points[points.length - 1].t : 0;
  const x = (t) => left + (width - left - right) * (1 - (now - t) / span);
  const y = (v) => top + (height - top - bottom) * (1 - v / max);
  g.strokeStyle = "#1a1a1a";
  g.lineWidth = 1.6;
  for (const [name, dash] of series) {
    g.setLineDash(dash);
    g.beginPath();
    let drawing = false;
    for (const p of points) {
      const v = p[name];
      if (v === null || v === undefined || now - p.t > span) {
        drawing = false;
        continue;
      }
      if (drawing) g.lineTo(x(p.t), y(v));
      else g.moveTo(x(p.t), y(v));
      drawing = true;
    }
    g.stroke();
  }
  g.setLineDash([]);
}

function niceCeil(v) {
  const exp = Math.pow(10, Math.floor(Math.log10(v)));
  for (const m of [1, 2, 5, 10]) if (v <= m * exp) return m * exp;
  return 10 * exp;
}

// -- faults ---------------------------------------------------------------------------------
async function arm(kind) {
  const after = Math.max(1, parseInt($("after-steps").value, 10) || 1);
  await admin("POST", { kind: kind, after_steps: after }, "armed " + kind + " after " + after + " step(s)");
}

async function admin(method, body, done) {
  const headers = authHeaders();
  if (body) headers["Content-Type"] = "application/json";
  const resp = await fetch("admin/faults", { method, headers, body: body ? JSON.stringify(body) : undefined });
  $("fault-result").textContent = resp.ok ? done : "refused (" + resp.status + "): " + (await errorMessage(resp));
}

// -- start ----------------------------------------------------------------------------------
$("key-form").addEventListener("submit", (e) => {
  e.preventDefault();
  sessionStorage.setItem(STORE, $("key").value.trim());
  $("key").value = "";
  connect();
});
$("clear-faults").addEventListener("click", () => admin("DELETE", null, "faults cleared"));
// the stream stops when the tab closes or the page is left
window.addEventListener("pagehide", () => controller && controller.abort());
if (location.hash.startsWith("#key=")) {
  sessionStorage.setItem(STORE, decodeURIComponent(location.hash.slice(5)));
  history.replaceState(null, "", location.pathname + location.search);
}
connect();
