// Panel 3: your model. Attention maps of every layer and head for the typed text (the server records
// them with qkv.attention.record_attention), the next-token distribution under temperature, top-k and
// top-p (qkv.generation), and generation one token per key press.
import { $, block, debounce, el, fmt, heatmap, live, post, say, showToken, unpack } from "./common.js";

// `generation` counts the times the text or the run changed: an answer to an older one is dropped.
const state = { run: null, info: null, maps: null, kind: null, layer: 0, head: 0, revealed: Infinity,
  ids: null, steps: 0, generation: 0, stepping: false, revealTimer: null };
const KIND_NAMES = { self: "self-attention", encoder: "encoder self-attention", decoder: "decoder self-attention",
  cross: "cross-attention (output → source)" };

function text() { return $("model-text").value; }

function sampling() {
  const k = Number($("gen-topk").value);
  return { temperature: Number($("gen-temperature").value), top_k: k === 0 ? null : k, top_p: Number($("gen-topp").value) };
}

// One kind of attention from the answer: its tokens and one (T_q × T_k) matrix per layer and head.
function readKind(kind) {
  const weights = unpack(kind.weights), scores = unpack(kind.scores);
  const [layers, heads, tq, tk] = weights.shape;
  const at = (values, l, h) => block(values, ((l * heads) + h) * tq * tk, tq, tk);
  return { layers, heads, tq, tk, queries: kind.query_tokens, keys: kind.key_tokens,
    weights: (l, h) => at(weights.values, l, h), scores: (l, h) => at(scores.values, l, h) };
}

function drawAttention(answer) {
  if (answer.run !== state.run) return; // an answer for the run shown before
  state.maps = Object.fromEntries(Object.entries(answer.kinds).map(([name, kind]) => [name, readKind(kind)]));
  if (!state.maps[state.kind]) state.kind = Object.keys(state.maps)[0];
  $("model-translation").textContent = answer.translation !== undefined ? `→ “${answer.translation}”` : "";
  state.revealed = answer.translation !== undefined ? 0 : Infinity;
  clearTimeout(state.revealTimer);
  drawGrid();
  drawSelected();
  if (answer.translation !== undefined) reveal();
}

// Translation: show the cross-attention row by row, as each English token is decoded.
function reveal() {
  const map = state.maps && state.maps[state.kind];
  if (!map) return; // another run is opening
  if (state.revealed >= map.tq) { state.revealed = Infinity; drawSelected(); return; }
  state.revealed += 1;
  drawSelected();
  state.revealTimer = setTimeout(reveal, 120);
}

function drawGrid() {
  const map = state.maps[state.kind];
  if ($("model-layer").options.length !== map.layers) { // an encoder and a decoder may differ in depth
    $("model-layer").replaceChildren(...Array.from({ length: map.layers }, (_, l) => el("option", { value: l, text: l })));
    state.layer = Math.min(state.layer, map.layers - 1);
    $("model-layer").value = String(state.layer);
  }
  const grid = $("model-grid");
  grid.replaceChildren();
  for (let l = 0; l < map.layers; l++) {
    for (let h = 0; h < map.heads; h++) {
      const canvas = el("canvas", { width: 120, height: 120, "data-kind": state.kind, "data-layer": l, "data-head": h });
      const weights = map.weights(l, h);
      canvas.qkvWeights = weights; // the numbers behind the picture, for anyone who asks (the tests do)
      heatmap(canvas, weights);
      canvas.addEventListener("click", () => { state.layer = l; state.head = h; syncSelects(); drawSelected(); });
      const selected = l === state.layer && h === state.head;
      grid.append(el("figure", { class: selected ? "selected" : "" }, canvas,
        el("figcaption", { text: `layer ${l} · head ${h}` })));
    }
  }
}

function syncSelects() {
  $("model-layer").value = String(state.layer);
  $("model-head").value = String(state.head);
  document.querySelectorAll("#model-grid figure").forEach((f) => {
    const c = f.querySelector("canvas");
    f.classList.toggle("selected", Number(c.dataset.layer) === state.layer && Number(c.dataset.head) === state.head);
  });
}

function drawSelected() {
  const map = state.maps && state.maps[state.kind];
  if (!map) return;
  const weights = map.weights(state.layer, state.head).map((row, r) => (r < state.revealed ? row : row.map(() => NaN)));
  const canvas = $("model-heatmap");
  canvas.qkvWeights = map.weights(state.layer, state.head);
  canvas.qkvGeometry = heatmap(canvas, weights, { labels: { rows: map.queries.map(showToken), cols: map.keys.map(showToken) } });
  showRow(Math.min(state.revealed, map.tq) - 1);
}

function showRow(r) {
  const map = state.maps && state.maps[state.kind];
  if (!map || r < 0 || r >= map.tq) return;
  const weights = map.weights(state.layer, state.head)[r], scores = map.scores(state.layer, state.head)[r];
  $("model-row-label").textContent = `query ${r}: “${showToken(map.queries[r])}”, layer ${state.layer}, head ${state.head}`;
  $("model-row").replaceChildren(
    el("tr", {}, el("th", { text: "key" }), el("th", { text: "score q·k/√d (before softmax)" }), el("th", { text: "weight" })),
    ...map.keys.map((k, c) => el("tr", {}, el("td", { text: showToken(k) }), el("td", { text: fmt(scores[c], 4) }),
      el("td", { text: fmt(weights[c], 4) }))),
  );
}

function onHover(event) {
  const g = $("model-heatmap").qkvGeometry;
  if (!g) return;
  const rect = event.target.getBoundingClientRect();
  const y = (event.clientY - rect.top) * (event.target.height / rect.height);
  showRow(Math.floor((y - g.margin) / g.h));
}

function drawDistribution(d) {
  $("gen-dist").replaceChildren(...d.tokens.map((token, i) => el("div", { class: "bar-row", "data-token": token },
    el("span", { class: "token", text: showToken(token) }),
    el("span", { class: "track" }, el("span", { class: "model", style: `width:${100 * d.model_probs[i]}%` }),
      el("span", { class: "shaped", style: `width:${100 * d.probs[i]}%` })),
    el("span", { class: "prob", text: `${fmt(d.probs[i], 4)} (model ${fmt(d.model_probs[i], 4)})` }))),
  el("p", { class: "note", text: `${d.kept} token(s) keep probability; entropy ${fmt(d.entropy, 3)} nats; greedy: “${showToken(d.tokens[0])}”` }));
}

function generationRequest() {
  return state.ids ? { ids: state.ids } : { text: text() };
}

// Each request remembers which run and text it was for; draw() drops answers that no longer apply.
function forNow(request) {
  return async () => {
    const [run, generation] = [state.run, state.generation];
    const answer = await request();
    return { ...answer, run: generation === state.generation ? run : null };
  };
}

const refreshAttention = live(forNow(() => post("attention", { run: state.run, text: text() })), drawAttention);
const refreshNext = live(forNow(() => post("next", { run: state.run, ...generationRequest(), ...sampling() })),
  (d) => { if (d.run === state.run) drawDistribution(d); });

async function step() {
  if (!state.info || !state.info.causal || state.stepping) return;
  state.stepping = true; // one token at a time: a held key or a double click must not send the same step twice
  const generation = state.generation;
  try {
    const answer = await post("step", { run: state.run, ...generationRequest(), ...sampling(), seed: 1000 + state.steps });
    if (generation !== state.generation) return;
    state.ids = answer.ids;
    state.steps += 1;
    const output = $("gen-output");
    output.append(el("span", { class: "generated", text: answer.token_text }));
    const rows = unpack(answer.rows);
    const [layers, heads, t] = rows.shape;
    $("gen-row").replaceChildren(...Array.from({ length: layers }, (_, l) => {
      const canvas = el("canvas", { width: 360, height: 16 * heads, "data-layer": l });
      heatmap(canvas, block(rows.values, l * heads * t, heads, t));
      return el("figure", {}, canvas, el("figcaption", {
        text: `layer ${l}: how “${showToken(answer.window_tokens.at(-1))}” attended over the last ${t} tokens (one row per head)` }));
    }));
    say("");
    refreshNext(); // the distribution of the token after this one
  } catch (err) {
    say(err.message, true);
  } finally {
    state.stepping = false;
  }
}

function resetGeneration() {
  state.generation += 1;
  state.ids = null; state.steps = 0;
  $("gen-output").replaceChildren(el("span", { class: "prompt", text: text() }));
  $("gen-row").replaceChildren();
}

async function openRun(name) {
  state.run = name;
  state.info = null;
  state.maps = null;
  clearTimeout(state.revealTimer);
  const info = await post("model", { run: name });
  if (state.run !== name) return; // another run was chosen meanwhile
  state.info = info;
  $("model-info").textContent = `${info.task} · ${info.n_layers} layers · ${info.n_heads} heads · context ${info.max_positions}`;
  const kinds = info.task === "translate" ? ["cross", "encoder", "decoder"] : ["self"];
  $("model-kind").replaceChildren(...kinds.map((k) => el("option", { value: k, text: KIND_NAMES[k] })));
  state.kind = kinds[0];
  $("model-layer").replaceChildren(...Array.from({ length: info.n_layers }, (_, l) => el("option", { value: l, text: l })));
  $("model-head").replaceChildren(...Array.from({ length: info.n_heads }, (_, h) => el("option", { value: h, text: h })));
  state.layer = 0; state.head = 0;
  $("gen-panel").hidden = !info.causal;
  if (info.task === "translate" && text() === "ROMEO: But, soft!") $("model-text").value = "Wie geht es dir?";
  if (info.chat_prompt && text() === "ROMEO: But, soft!") $("model-text").value = info.chat_prompt;  // a chat run: its template
  resetGeneration();
  await Promise.all([refreshAttention(), info.causal ? refreshNext() : null]);
}

// Set up the panel on the runs the server offers ({runs, default}) whose models read text (not SAEs).
export async function initModel({ runs: offered, default: preferred }) {
  const runs = offered.filter((r) => r.task !== "sae");
  $("model-empty").hidden = runs.length > 0;
  $("model-body").hidden = runs.length === 0;
  if (runs.length === 0) return;
  $("model-run").replaceChildren(...runs.map((r) => el("option", { value: r.name, text: `${r.name} (${r.task})` })));
  $("model-run").addEventListener("change", (e) => openRun(e.target.value).catch((err) => say(err.message, true)));
  $("model-text").addEventListener("input", debounce(() => {
    if (!state.info) return;
    resetGeneration(); refreshAttention(); if (state.info.causal) refreshNext();
  }));
  $("model-kind").addEventListener("change", (e) => {
    state.kind = e.target.value;
    if (state.maps && state.maps[state.kind]) { drawGrid(); drawSelected(); }
  });
  $("model-layer").addEventListener("change", (e) => { state.layer = Number(e.target.value); syncSelects(); drawSelected(); });
  $("model-head").addEventListener("change", (e) => { state.head = Number(e.target.value); syncSelects(); drawSelected(); });
  $("model-heatmap").addEventListener("mousemove", onHover);
  for (const [id, show] of [["gen-temperature", (v) => v], ["gen-topk", (v) => (v === "0" ? "off" : v)], ["gen-topp", (v) => v]]) {
    $(id).addEventListener("input", () => { $(`${id}-value`).textContent = show($(id).value); refreshNext(); });
  }
  $("gen-step").addEventListener("click", step);
  $("gen-reset").addEventListener("click", () => { resetGeneration(); if (state.info) refreshNext(); });
  document.addEventListener("keydown", (e) => {
    const typing = ["TEXTAREA", "INPUT", "SELECT"].includes(document.activeElement?.tagName);
    if (e.key === "ArrowRight" && !e.repeat && !typing && $("model").classList.contains("active")) {
      e.preventDefault();
      step();
    }
  });
  await openRun(runs.find((r) => r.name === preferred) ? preferred : runs[0].name);
}
