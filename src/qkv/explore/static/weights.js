// Panel 2: self-attention with trainable W_q, W_k, W_v (qkv.lab.trainable_walkthrough), and
// multi-head attention split shape by shape (qkv.lab.heads).
import { $, el, heatmap, live, matrixTable, post } from "./common.js";

function figure(title, shape, table) {
  return el("figure", {}, el("figcaption", {}, el("b", { text: title }), ` (${shape.join(" × ")})`), table);
}

function drawTrainable(a) {
  const words = a.words;
  const cols = (n) => Array.from({ length: n }, (_, j) => String(j));
  const signed = (rows) => {
    const top = Math.max(...rows.flat().filter((v) => v !== null).map(Math.abs), 1e-9);
    const heat = (v) => (v === null ? NaN : v / top);
    heat.signed = true;
    return heat;
  };
  const weightHeat = (v) => v;
  const matrix = (rows, rowLabels, colLabels, id, heat) => matrixTable(rows, { rowLabels, colLabels, id, heat });
  $("tw-matrices").replaceChildren(
    figure("X: the words' embeddings", [words.length, a.d_in], matrix(a.x, words, cols(a.d_in), "tw-x", signed(a.x))),
    figure("W_q", [a.d_in, a.d_out], matrix(a.w_q, null, cols(a.d_out), "tw-wq", signed(a.w_q))),
    figure("W_k", [a.d_in, a.d_out], matrix(a.w_k, null, cols(a.d_out), "tw-wk", signed(a.w_k))),
    figure("W_v", [a.d_in, a.d_out], matrix(a.w_v, null, cols(a.d_out), "tw-wv", signed(a.w_v))),
    figure("Q = X W_q", [words.length, a.d_out], matrix(a.q, words, cols(a.d_out), "tw-q", signed(a.q))),
    figure("K = X W_k", [words.length, a.d_out], matrix(a.k, words, cols(a.d_out), "tw-k", signed(a.k))),
    figure("V = X W_v", [words.length, a.d_out], matrix(a.v, words, cols(a.d_out), "tw-v", signed(a.v))),
    figure("scores = Q Kᵀ", [words.length, words.length],
      matrix(a.scores, words, words, "tw-scores", signed(a.scores))),
    figure(`scaled = scores / √${a.d_out}` + (a.causal ? ", masked" : ""), [words.length, words.length],
      matrix(a.scaled, words, words, "tw-scaled", signed(a.scaled))),
    figure("weights = softmax(scaled), row by row", [words.length, words.length],
      matrix(a.weights, words, words, "tw-weights", weightHeat)),
    figure("context = weights V", [words.length, a.d_out],
      matrix(a.context, words, cols(a.d_out), "tw-context", signed(a.context))),
  );
}

function drawHeads(a) {
  const t = a.tokens.length;
  $("mh-flow").textContent = `(${t}, ${a.d_model}) → ${a.n_heads} × (${t}, ${a.d_k}) → concat (${t}, ${a.d_model})`
    + ` → W_O → (${t}, ${a.d_model});  ${a.n_params.toLocaleString()} parameters;`
    + `  step by step vs the module: max |difference| ${a.max_abs_diff.toExponential(1)}`;
  $("mh-steps").replaceChildren(
    el("tr", {}, el("th", { text: "step" }), el("th", { text: "computed as" }), el("th", { text: "shape" })),
    ...a.steps.map((s) => el("tr", {}, el("td", { text: s.name }), el("td", { text: s.formula }),
      el("td", { class: "shape", text: `(${s.shape.join(", ")})` }))),
  );
  const top = Math.max(...a.weights.flat(2));
  $("mh-grid").replaceChildren(...a.weights.map((w, h) => {
    const canvas = el("canvas", { width: 150, height: 150, "data-head": h });
    heatmap(canvas, w, { lo: 0, hi: top });
    return el("figure", {}, canvas, el("figcaption", { text: `head ${h + 1}: (${t}, ${t})` }));
  }));
}

// Set up the trainable-weights and multi-head views.
export async function initWeights() {
  const trainable = live(() => post("trainable", { seed: Number($("tw-seed").value), causal: $("tw-causal").checked }),
    drawTrainable);
  const heads = live(() => post("multihead", { n_heads: Number($("mh-heads").value), seed: Number($("mh-seed").value) }),
    drawHeads);
  $("tw-seed").addEventListener("input", trainable);
  $("tw-causal").addEventListener("change", trainable);
  $("mh-heads").addEventListener("change", heads);
  $("mh-seed").addEventListener("input", heads);
  await Promise.all([trainable(), heads()]);
}
