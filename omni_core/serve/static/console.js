// The omni console: the graph, the live state pushed by /console/events, the playground and the
// recent requests. Plain JavaScript, no dependency: the page works offline.
"use strict";

const SVG = "http://www.w3.org/2000/svg";
const PALETTE = ["#3558d6", "#1f8a4c", "#b7791f", "#8a4fd6", "#d6683a", "#2b8a9e", "#9e2b7a", "#5a6b1f"];
const NODE_W = 156, NODE_H = 58, COL_W = 246, ROW_H = 74, BAND_PAD = 22, MARGIN = 16;

let topology = null;
let stageColor = {};
let exampleShown = false;

// -- small helpers -----------------------------------------------------------------------------------

function $(id) { return document.getElementById(id); }

function el(tag, attrs, text) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
  if (text !== undefined) node.textContent = text;
  return node;
}

function svg(tag, attrs, text) {
  const node = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
  if (text !== undefined) node.textContent = text;
  return node;
}

function seconds(s) {
  if (s === null || s === undefined) return "–";
  if (s < 1) return (s * 1000).toFixed(s < 0.01 ? 2 : 1) + " ms";
  return s.toFixed(2) + " s";
}

function bytes(n) {
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i += 1; }
  return `${n.toFixed(i && n < 10 ? 1 : 0)} ${units[i]}`;
}

function rate(r) { return r >= 10 ? r.toFixed(0) : r.toFixed(1); }

function setState(node, state) {
  node.className = node.className.replace(/\bstate-\S+/g, "").trim();
  node.classList.add("state-" + state);
}

// Long base64 strings (tensors, bytes, audio) shown by their size.
function abbreviate(value) {
  if (Array.isArray(value)) return value.map(abbreviate);
  if (value && typeof value === "object") {
    if (typeof value.base64 === "string" && Object.keys(value).length === 1) return `<${Math.floor(value.base64.length * 3 / 4)} bytes>`;
    if (typeof value.data === "string" && value.dtype && value.shape) return `<tensor ${value.dtype} [${value.shape.join(", ")}]>`;
    const out = {};
    for (const [k, v] of Object.entries(value)) out[k] = abbreviate(v);
    return out;
  }
  return value;
}

// -- the graph ------------------------------------------------------------------------------------------

function layout(topo) {
  // Columns: the longest path from the entry over payload and stream edges (a declared cycle
  // stops growing after as many rounds as there are stages).
  const col = {};
  topo.stages.forEach((s) => { col[s] = 0; });
  for (let round = 0; round < topo.stages.length; round++) {
    let changed = false;
    for (const e of topo.edges) {
      if (col[e.dst] < col[e.src] + 1) { col[e.dst] = col[e.src] + 1; changed = true; }
    }
    if (!changed) break;
  }
  // Rows: one band per process group; stages of a group in the same column stack inside it.
  const pos = {}, bands = [];
  let y = MARGIN;
  for (const g of topo.groups) {
    const used = {};
    let rows = 1;
    for (const s of g.stages) {
      const r = used[col[s]] || 0;
      used[col[s]] = r + 1;
      rows = Math.max(rows, r + 1);
      pos[s] = { col: col[s], row: r, x: MARGIN + (col[s] + 1) * COL_W, y: y + BAND_PAD + r * ROW_H };
    }
    const cols = g.stages.map((s) => col[s]);
    bands.push({ group: g, y, height: BAND_PAD + rows * ROW_H - (ROW_H - NODE_H) + 10,
                 x0: MARGIN + (Math.min(...cols) + 1) * COL_W - 10, x1: MARGIN + (Math.max(...cols) + 1) * COL_W + NODE_W + 10 });
    y += BAND_PAD + rows * ROW_H + 14;
  }
  const maxCol = Math.max(0, ...Object.values(col));
  return { pos, bands, width: MARGIN * 2 + (maxCol + 2) * COL_W + NODE_W - 50, height: y + MARGIN };
}

function curve(x1, y1, x2, y2) {
  const dx = Math.max(40, Math.abs(x2 - x1) / 2);
  const p = [[x1, y1], [x1 + dx, y1], [x2 - dx, y2], [x2, y2]];
  const mid = [(p[0][0] + 3 * p[1][0] + 3 * p[2][0] + p[3][0]) / 8, (p[0][1] + 3 * p[1][1] + 3 * p[2][1] + p[3][1]) / 8];
  return { d: `M${x1},${y1} C${p[1][0]},${p[1][1]} ${p[2][0]},${p[2][1]} ${x2},${y2}`, mid };
}

function renderGraph(topo) {
  const { pos, bands, width, height } = layout(topo);
  const root = svg("svg", { viewBox: `0 0 ${width} ${height}`, role: "img", "aria-label": `graph of pipeline ${topo.pipeline}` });
  const defs = svg("defs");
  for (const [id, color] of [["arrow", "#7b8499"], ["arrow-stream", "#8a4fd6"]]) {
    const marker = svg("marker", { id, viewBox: "0 0 10 10", refX: "9", refY: "5", markerWidth: "7", markerHeight: "7", orient: "auto-start-reverse" });
    marker.appendChild(svg("path", { d: "M0,0 L10,5 L0,10 z", fill: color }));
    defs.appendChild(marker);
  }
  root.appendChild(defs);
  for (const band of bands) {
    const g = svg("g", { "data-testid": `group-${band.group.name}` });
    g.appendChild(svg("rect", { class: "group-box", id: `group-box-${band.group.name}`, x: band.x0, y: band.y, width: band.x1 - band.x0, height: band.height, rx: 8 }));
    g.appendChild(svg("text", { class: "group-label", x: band.x0 + 8, y: band.y + 14 }, `process ${band.group.label}`));
    root.appendChild(g);
  }
  const edges = svg("g");
  const labels = svg("g");
  const mid = (s) => pos[s].y + NODE_H / 2;
  // the caller: input into the entry stage, terminal stages' answers out
  const inY = mid(topo.entry);
  const outX = Math.max(...topo.terminal_stages.map((s) => pos[s].x + NODE_W)) + 60;
  const outY = topo.terminal_stages.reduce((a, s) => a + mid(s), 0) / topo.terminal_stages.length;
  for (const [label, x, y] of [["input", MARGIN, inY], ["output", outX, outY]]) {
    const g = svg("g", { class: "io" });
    g.appendChild(svg("rect", { x, y: y - 14, width: 64, height: 28, rx: 14 }));
    g.appendChild(svg("text", { x: x + 32, y: y + 4, "text-anchor": "middle" }, label));
    root.appendChild(g);
  }
  edges.appendChild(svg("path", { class: "edge", d: curve(MARGIN + 64, inY, pos[topo.entry].x, mid(topo.entry)).d, "marker-end": "url(#arrow)" }));
  for (const s of topo.terminal_stages) {
    edges.appendChild(svg("path", { class: "edge", d: curve(pos[s].x + NODE_W, mid(s), outX, outY).d, "marker-end": "url(#arrow)" }));
  }
  for (const e of topo.edges) {
    const stream = e.kind === "stream";
    const shift = stream ? 8 : 0;
    const c = curve(pos[e.src].x + NODE_W, mid(e.src) + shift, pos[e.dst].x, mid(e.dst) + shift);
    edges.appendChild(svg("path", { class: "edge" + (stream ? " stream" : ""), d: c.d, "marker-end": `url(#${stream ? "arrow-stream" : "arrow"})`,
                                     "data-testid": `edge-${e.src}-${e.dst}-${e.kind}` }));
    // payload labels above their line, stream labels below theirs
    const w = e.label.length * 5.6 + 8, y = c.mid[1] + (stream ? 12 : -8);
    labels.appendChild(svg("rect", { class: "edge-label-bg", x: c.mid[0] - w / 2, y: y - 8, width: w, height: 13, rx: 3 }));
    labels.appendChild(svg("text", { class: "edge-label" + (stream ? " stream" : ""), x: c.mid[0], y: y + 2, "text-anchor": "middle",
                                     "data-testid": `edge-label-${e.src}-${e.dst}-${e.kind}` }, e.label));
  }
  root.appendChild(edges);
  for (const s of topo.stages) {
    const p = pos[s];
    const g = svg("g", { class: "node", "data-testid": `stage-${s}`, transform: `translate(${p.x},${p.y})` });
    g.appendChild(svg("rect", { width: NODE_W, height: NODE_H, rx: 6 }));
    g.appendChild(svg("text", { class: "name", x: 10, y: 18 }, s));
    g.appendChild(svg("text", { class: "stat", x: 10, y: 35, id: `node-a-${s}` }, "in flight 0 · 0 calls/s"));
    g.appendChild(svg("text", { class: "stat", x: 10, y: 50, id: `node-b-${s}` }, "p50 – · errors 0"));
    root.appendChild(g);
  }
  root.appendChild(labels);
  const holder = $("graph");
  holder.replaceChildren(root);
}

// -- live state ---------------------------------------------------------------------------------------

function onTopology(topo) {
  topology = topo;
  topo.stages.forEach((s, i) => { stageColor[s] = PALETTE[i % PALETTE.length]; });
  $("pipeline-name").textContent = topo.pipeline;
  $("description").textContent = topo.description || "";
  document.title = `omni console · ${topo.pipeline}`;
  renderGraph(topo);
  const body = $("stage-table").tBodies[0];
  body.replaceChildren(...topo.stages.map((s) => {
    const tr = el("tr", { "data-testid": `stage-row-${s}` });
    tr.appendChild(el("td", {}, s));
    for (const key of ["in_flight", "calls", "requests_per_s", "p50", "p99", "errors", "chunks"]) {
      tr.appendChild(el("td", { "data-testid": `stage-${key.replace(/_/g, "-")}-${s}` }, "–"));
    }
    return tr;
  }));
  if (!exampleShown) {
    exampleShown = true;
    $("playground-input").value = JSON.stringify(topo.example, null, 2);
  }
  // the tabs of the OpenAI-style routes a mounted API serves this pipeline (chat, speech, transcription)
  document.querySelector('[data-tab="chat"]').hidden = !topo.chat;
  document.querySelector('[data-tab="speech"]').hidden = !topo.speech;
  document.querySelector('[data-tab="transcribe"]').hidden = !topo.transcription;
}

function onState(st) {
  const p = st.pipeline;
  const badge = $("pipeline-state");
  badge.textContent = p.state;
  setState(badge, p.state === "running" && p.ready ? "ready" : p.state);
  $("updated").textContent = `updated ${new Date(st.time * 1000).toLocaleTimeString()}`;
  const requests = p.requests || {};
  const total = Object.values(requests).reduce((a, b) => a + b, 0);
  const failed = total - (requests.ok || 0);
  const rows = [["pipeline state", p.state, "pipeline-state-cell"], ["ready", p.ready ? "yes" : "no", "pipeline-ready"],
                ["requests in flight", p.in_flight, "pipeline-in-flight"], ["requests/s", rate(p.requests_per_s), "pipeline-rps"],
                ["requests (ok / not ok)", `${requests.ok || 0} / ${failed}`, "pipeline-requests"],
                ["latency p50 / p99", `${seconds(p.p50)} / ${seconds(p.p99)}`, "pipeline-latency"], ["restarts", p.restarts, "pipeline-restarts"]];
  $("pipeline-table").tBodies[0].replaceChildren(...rows.map(([k, v, id]) => {
    const tr = el("tr");
    tr.appendChild(el("th", {}, k));
    const td = el("td", { "data-testid": id }, String(v));
    if (id === "pipeline-state-cell") setState(td, p.state);
    tr.appendChild(td);
    return tr;
  }));
  $("process-table").tBodies[0].replaceChildren(...Object.entries(st.processes).map(([name, info]) => {
    const tr = el("tr", { "data-testid": `process-row-${name}` });
    tr.appendChild(el("td", {}, name));
    tr.appendChild(el("td", {}, info.pid === null ? "–" : String(info.pid)));
    const state = el("td", { "data-testid": `process-state-${name}` }, info.state);
    setState(state, info.state);
    tr.appendChild(state);
    tr.appendChild(el("td", { "data-testid": `process-restarts-${name}` }, String(info.restarts)));
    return tr;
  }));
  $("relay-table").tBodies[0].replaceChildren(...(st.relays || []).map((r) => {
    const tr = el("tr", { "data-testid": `relay-row-${r.src}-${r.dst}` });
    for (const v of [r.relay, r.src, r.dst, bytes(r.bytes), bytes(r.bytes_per_s)]) tr.appendChild(el("td", {}, v));
    return tr;
  }));
  if (!topology) return;
  for (const [name, s] of Object.entries(st.stages)) {
    const cells = { in_flight: s.in_flight, calls: s.calls, requests_per_s: rate(s.requests_per_s), p50: seconds(s.p50),
                    p99: seconds(s.p99), errors: s.errors, chunks: s.chunks };
    for (const [key, v] of Object.entries(cells)) {
      const td = document.querySelector(`[data-testid="stage-${key.replace(/_/g, "-")}-${name}"]`);
      if (td) td.textContent = String(v);
    }
    const a = $(`node-a-${name}`), b = $(`node-b-${name}`);
    if (a) a.textContent = `in flight ${s.in_flight} · ${rate(s.requests_per_s)} calls/s`;
    if (b) b.textContent = `p50 ${seconds(s.p50)} · errors ${s.errors}`;
    const node = document.querySelector(`[data-testid="stage-${name}"]`);
    if (node) {
      node.classList.toggle("busy", s.in_flight > 0);
      node.classList.toggle("failing", s.errors > 0);
    }
  }
  for (const g of topology.groups) {
    const states = g.processes.map((proc) => (st.processes[proc.name] || {}).state).filter(Boolean);
    const worst = ["dead", "restarting", "stopped", "stopping", "starting", "running"].find((x) => states.includes(x));
    const box = $(`group-box-${g.name}`);
    if (box && worst) box.setAttribute("class", `group-box state-${worst}`);
  }
  renderRecent(st.recent || []);
}

function renderRecent(recent) {
  const legend = el("div", { class: "legend-row" });
  for (const s of topology ? topology.stages : []) {
    const key = el("span", { class: "key" });
    const swatch = el("i");
    swatch.style.background = stageColor[s];
    key.append(swatch, s);
    legend.appendChild(key);
  }
  const table = el("table");
  const head = el("tr");
  for (const h of ["request", "status", "latency", "timeline (per stage)"]) head.appendChild(el("th", {}, h));
  table.appendChild(el("thead")).appendChild(head);
  const body = table.appendChild(el("tbody"));
  for (const r of recent) {
    const tr = el("tr", { "data-testid": "recent-row" });
    tr.appendChild(el("td", {}, r.id || "–"));
    const status = el("td", { "data-testid": "recent-status" }, r.error && r.error.stage ? `${r.status} (${r.error.stage})` : r.status);
    setState(status, r.status);
    tr.appendChild(status);
    tr.appendChild(el("td", {}, seconds(r.seconds)));
    const cell = el("td");
    const bar = el("div", { class: "timeline", "data-testid": "timeline" });
    const span = Math.max(r.seconds, ...r.stages.map((c) => c.start + c.seconds), 1e-6);
    // one lane per stage, in the pipeline's order: calls that overlap in time stay visible
    const order = topology ? topology.stages : [];
    const lanes = [...new Set(r.stages.map((c) => c.stage))].sort((a, b) => order.indexOf(a) - order.indexOf(b));
    bar.style.height = `${Math.max(1, lanes.length) * 5 + 2}px`;
    for (const c of r.stages) {
      const seg = el("div", { class: `seg status-${c.status}`, title: `${c.stage}: ${seconds(c.seconds)} from +${seconds(c.start)} (${c.status})` });
      seg.style.top = `${1 + 5 * lanes.indexOf(c.stage)}px`;
      seg.style.left = `${(100 * c.start / span).toFixed(2)}%`;
      seg.style.width = `${(100 * c.seconds / span).toFixed(2)}%`;
      seg.style.background = stageColor[c.stage] || "#888";
      bar.appendChild(seg);
    }
    cell.appendChild(bar);
    const parts = r.stages.map((c) => `${c.stage} ${seconds(c.seconds)} from +${seconds(c.start)}${c.status === "ok" ? "" : " (" + c.status + ")"}`);
    for (const [stage, [count, first]] of Object.entries(r.chunks || {})) parts.push(`${stage}: ${count} chunks, first at +${seconds(first)}`);
    bar.setAttribute("title", parts.join("\n"));
    tr.appendChild(cell);
    body.appendChild(tr);
  }
  $("recent").replaceChildren(...(recent.length ? [legend, table] : [el("p", { class: "muted" }, "No request yet.")]));
}

function connect() {
  const source = new EventSource("/console/events" + location.search);
  source.addEventListener("topology", (ev) => onTopology(JSON.parse(ev.data)));
  source.addEventListener("state", (ev) => { $("connection").textContent = ""; onState(JSON.parse(ev.data)); });
  source.onerror = () => { $("connection").textContent = "reconnecting…"; };
}

// -- the playground -------------------------------------------------------------------------------------

// Reads a text/event-stream response, calling onEvent(name, data) for each event as it arrives.
async function readEvents(response, onEvent) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      let name = "message";
      const data = [];
      for (const line of block.split("\n")) {
        if (line.startsWith("event:")) name = line.slice(6).trim();
        else if (line.startsWith("data:")) data.push(line.slice(5).replace(/^ /, ""));
      }
      if (data.length) onEvent(name, data.join("\n"));
    }
  }
}

async function errorText(response) {
  try {
    const body = await response.json();
    const e = body.error || {};
    return `${e.type || response.status}${e.stage ? " in stage " + e.stage : ""}: ${e.message || JSON.stringify(body)}`;
  } catch (_) {
    return `HTTP ${response.status}`;
  }
}

class AudioSink {
  constructor() { this.ctx = null; this.next = 0; this.parts = []; this.rate = 24000; }

  add(pcm16, sampleRate) {
    const raw = atob(pcm16);
    const bytes = new Uint8Array(raw.length);
    for (let i = 0; i < raw.length; i++) bytes[i] = raw.charCodeAt(i);
    this.parts.push(bytes);
    this.rate = sampleRate || this.rate;
    const view = new DataView(bytes.buffer);
    const n = Math.floor(bytes.length / 2);
    if (!n) return 0;
    try {
      if (!this.ctx) this.ctx = new AudioContext();
      const buffer = this.ctx.createBuffer(1, n, this.rate);
      const ch = buffer.getChannelData(0);
      for (let i = 0; i < n; i++) ch[i] = view.getInt16(2 * i, true) / 32768;
      const src = this.ctx.createBufferSource();
      src.buffer = buffer;
      src.connect(this.ctx.destination);
      const at = Math.max(this.ctx.currentTime + 0.05, this.next);
      src.start(at);
      this.next = at + buffer.duration;
    } catch (err) {
      $("playground-status").textContent = `audio cannot play here (${err.message}); the WAV download still works`;
    }
    return n;
  }

  wav() {
    const size = this.parts.reduce((a, p) => a + p.length, 0);
    const out = new Uint8Array(44 + size);
    const v = new DataView(out.buffer);
    const text = (at, s) => { for (let i = 0; i < s.length; i++) out[at + i] = s.charCodeAt(i); };
    text(0, "RIFF"); v.setUint32(4, 36 + size, true); text(8, "WAVE"); text(12, "fmt ");
    v.setUint32(16, 16, true); v.setUint16(20, 1, true); v.setUint16(22, 1, true); v.setUint32(24, this.rate, true);
    v.setUint32(28, this.rate * 2, true); v.setUint16(32, 2, true); v.setUint16(34, 16, true); text(36, "data"); v.setUint32(40, size, true);
    let at = 44;
    for (const p of this.parts) { out.set(p, at); at += p.length; }
    return new Blob([out], { type: "audio/wav" });
  }
}

function stageBlock(out, blocks, stage) {
  if (!blocks[stage]) {
    const block = el("div", { class: "stage-block", "data-testid": `output-stage-${stage}` });
    block.style.borderLeftColor = stageColor[stage] || "#888";
    const title = el("h3", {}, stage);
    block.appendChild(title);
    out.appendChild(block);
    blocks[stage] = { block, title, count: 0 };
  }
  return blocks[stage];
}

async function sendRequest() {
  const out = $("playground-output");
  const status = $("playground-status");
  const wavLink = $("playground-wav");
  let input;
  try {
    input = JSON.parse($("playground-input").value);
  } catch (err) {
    out.replaceChildren(el("div", { class: "error", "data-testid": "playground-error" }, `The input is not valid JSON: ${err.message}`));
    return;
  }
  const button = $("playground-send");
  button.disabled = true;
  out.replaceChildren();
  wavLink.hidden = true;
  status.textContent = "sending…";
  const blocks = {};
  const audio = new AudioSink();
  const began = performance.now();
  try {
    const response = await fetch("/console/requests" + location.search, { method: "POST", headers: { "content-type": "application/json" }, body: JSON.stringify({ input }) });
    if (!response.ok) {
      out.appendChild(el("div", { class: "error", "data-testid": "playground-error" }, await errorText(response)));
      status.textContent = "failed";
      return;
    }
    status.textContent = "streaming…";
    await readEvents(response, (name, text) => {
      const data = JSON.parse(text);
      if (name === "chunk") {
        const b = stageBlock(out, blocks, data.stage);
        b.count += 1;
        b.title.textContent = `${data.stage} · ${b.count} chunk${b.count > 1 ? "s" : ""}`;
        const chunk = data.data;
        let line;
        if (chunk && typeof chunk === "object" && chunk.pcm16 && typeof chunk.pcm16.base64 === "string") {
          const n = audio.add(chunk.pcm16.base64, chunk.sample_rate);
          line = `audio${chunk.index !== undefined ? " #" + chunk.index : ""}: ${n} samples at ${audio.rate} Hz`;
        } else {
          line = JSON.stringify(abbreviate(chunk));
        }
        b.block.appendChild(el("div", { class: "chunk", "data-testid": "playground-chunk" }, line));
      } else if (name === "result") {
        out.appendChild(el("div", { class: "result", "data-testid": "playground-result" }, "result: " + JSON.stringify(abbreviate(data.result), null, 2)));
        status.textContent = `done in ${seconds((performance.now() - began) / 1000)} (${data.id})`;
      } else if (name === "error") {
        const box = el("div", { class: "error", "data-testid": "playground-error" });
        box.appendChild(el("strong", {}, `${data.type}${data.stage ? " in stage " + data.stage : ""}`));
        box.appendChild(el("div", {}, data.message));
        if (data.traceback) box.appendChild(el("pre", { "data-testid": "playground-traceback" }, data.traceback));
        out.appendChild(box);
        status.textContent = "failed";
      }
      out.scrollTop = out.scrollHeight;
    });
    if (audio.parts.length) {
      wavLink.href = URL.createObjectURL(audio.wav());
      wavLink.download = "omni-playground.wav";
      wavLink.hidden = false;
    }
  } catch (err) {
    out.appendChild(el("div", { class: "error", "data-testid": "playground-error" }, `the request failed: ${err.message}`));
    status.textContent = "failed";
  } finally {
    button.disabled = false;
  }
}

// -- the chat tab (an API registered with chat=PATH) -------------------------------------------------------

const chatHistory = [];

async function sendChat() {
  const input = $("chat-input");
  const text = input.value.trim();
  if (!text || !topology) return;
  input.value = "";
  const log = $("chat-log");
  chatHistory.push({ role: "user", content: text });
  log.appendChild(el("div", { class: "chat-msg user" }, text));
  const answer = el("div", { class: "chat-msg assistant", "data-testid": "chat-answer" }, "");
  log.appendChild(answer);
  $("chat-send").disabled = true;
  try {
    const response = await fetch(topology.chat, {
      method: "POST", headers: { "content-type": "application/json" },
      body: JSON.stringify({ model: topology.pipeline, messages: chatHistory, stream: true }),
    });
    if (!response.ok) {
      answer.textContent = await errorText(response);
      answer.classList.add("state-error");
      chatHistory.pop();
      return;
    }
    let content = "";
    await readEvents(response, (_, data) => {
      if (data === "[DONE]") return;
      const msg = JSON.parse(data);
      if (msg.error) { answer.textContent = `${msg.error.type || "error"}: ${msg.error.message}`; answer.classList.add("state-error"); return; }
      const delta = (msg.choices && msg.choices[0] && msg.choices[0].delta) || {};
      if (delta.content) { content += delta.content; answer.textContent = content; }
    });
    chatHistory.push({ role: "assistant", content });
  } catch (err) {
    answer.textContent = `the request failed: ${err.message}`;
  } finally {
    $("chat-send").disabled = false;
  }
}

// -- the speech and transcribe tabs (an API registered with speech= / transcription=) ----------------------

// One request of a form tab: the button off while it runs, the status saying what it does, then the
// answer (onOk) or the error, in the API's words.
async function formRequest(button, status, busy, path, init, onOk) {
  button.disabled = true;
  status.textContent = busy;
  status.classList.remove("state-error");
  try {
    const response = await fetch(path, init);
    if (!response.ok) throw new Error(await errorText(response));
    status.textContent = await onOk(response);
  } catch (err) {
    status.textContent = err.message;
    status.classList.add("state-error");
  } finally {
    button.disabled = false;
  }
}

async function sendSpeech() {
  const text = $("speech-input").value.trim();
  if (!text || !topology || !topology.speech) return;
  const body = { model: topology.pipeline, input: text, voice: $("speech-voice").value.trim(), response_format: "wav" };
  await formRequest($("speech-send"), $("speech-status"), "speaking…", topology.speech,
    { method: "POST", headers: { "content-type": "application/json" }, body: JSON.stringify(body) },
    async (response) => {
      const wav = await response.blob();
      const player = $("speech-audio");
      if (player.src) URL.revokeObjectURL(player.src);
      player.src = URL.createObjectURL(wav);
      player.hidden = false;
      return `${wav.size} bytes of WAV`;
    });
}

async function sendTranscription() {
  const file = $("transcribe-file").files[0];
  if (!file || !topology || !topology.transcription) return;
  const form = new FormData();
  form.append("file", file, file.name);
  form.append("model", topology.pipeline);
  await formRequest($("transcribe-send"), $("transcribe-status"), "transcribing…", topology.transcription,
    { method: "POST", body: form },
    async (response) => {
      $("transcribe-text").textContent = (await response.json()).text;
      return file.name;
    });
}

function showTab(name) {
  for (const tab of document.querySelectorAll(".tab")) tab.classList.toggle("active", tab.dataset.tab === name);
  for (const body of ["request", "chat", "speech", "transcribe"]) $(`tab-${body}`).hidden = name !== body;
}

document.addEventListener("DOMContentLoaded", () => {
  $("playground-send").addEventListener("click", sendRequest);
  $("chat-send").addEventListener("click", sendChat);
  $("chat-input").addEventListener("keydown", (ev) => { if (ev.key === "Enter") sendChat(); });
  $("speech-send").addEventListener("click", sendSpeech);
  $("transcribe-send").addEventListener("click", sendTranscription);
  for (const tab of document.querySelectorAll(".tab")) tab.addEventListener("click", () => showTab(tab.dataset.tab));
  connect();
});
