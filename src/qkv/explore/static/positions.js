// Panel 4: the sinusoidal encoding (qkv.positional) with PE(p + k) as a rotation of PE(p), and
// BatchNorm, LayerNorm and RMSNorm (qkv.norms) on an editable batch.
import { $, el, heatmap, live, matrixTable, numberInput, post } from "./common.js";

const batch = [[1, 2, 3, 10], [2, 4, 6, 20], [0.5, -1, 3, 5], [3, 1, 0, 15]];

function drawVectors(canvas, series) {
  const ctx = canvas.getContext("2d");
  const { width, height } = canvas;
  ctx.clearRect(0, 0, width, height);
  const n = series[0].values.length, x = (i) => 30 + (i * (width - 40)) / Math.max(n - 1, 1);
  const y = (v) => height / 2 - v * (height / 2 - 24);
  ctx.strokeStyle = "#ccc"; ctx.beginPath(); ctx.moveTo(30, y(0)); ctx.lineTo(width - 10, y(0)); ctx.stroke();
  series.forEach(({ values, colour, dash, label }, s) => {
    ctx.strokeStyle = colour; ctx.setLineDash(dash); ctx.lineWidth = 2; ctx.beginPath();
    values.forEach((v, i) => (i ? ctx.lineTo(x(i), y(v)) : ctx.moveTo(x(i), y(v))));
    ctx.stroke(); ctx.setLineDash([]);
    ctx.fillStyle = colour; ctx.font = "12px system-ui, sans-serif"; ctx.fillText(label, 36 + 150 * s, 14);
  });
  ctx.fillStyle = "#555"; ctx.fillText("dimension →", width - 90, height - 4);
}

function drawPositions(a) {
  heatmap($("pe-heatmap"), a.table, { lo: -1, hi: 1, signed: true });
  const p = a.position, k = a.offset;
  drawVectors($("pe-vectors"), [
    { values: a.pe_p, colour: "#999", dash: [], label: `PE(${p})` },
    { values: a.pe_p_k, colour: "#d62728", dash: [], label: `PE(${p + k})` },
    { values: a.rotated, colour: "#1f77b4", dash: [6, 4], label: `M_${k} · PE(${p})` },
  ]);
  $("pe-error").textContent = a.rotation_error.toExponential(2);
}

function batchTable() {
  const table = $("norm-input");
  const header = el("tr", {}, el("th", { text: "token \\ feature" }), ...batch[0].map((_, j) => el("th", { text: `f${j}` })));
  table.replaceChildren(header, ...batch.map((row, i) => el("tr", {}, el("th", { text: `t${i}` }), ...row.map((v, j) =>
    el("td", {}, numberInput(v, { "data-row": i, "data-col": j }, (value) => { batch[i][j] = value; updateNorms(); }))))));
}

// Grow or shrink the batch (2 to 16 tokens and features, as the server accepts).
function resize(rows, cols) {
  if (rows < 2 || rows > 16 || cols < 2 || cols > 16) return;
  while (batch.length > rows) batch.pop();
  while (batch.length < rows) batch.push(batch[batch.length - 1].map((v, j) => v + j + 1));
  for (const row of batch) {
    while (row.length > cols) row.pop();
    while (row.length < cols) row.push(row.length);
  }
  batchTable();
  updateNorms();
}

function normFigure(title, id, s) {
  const rows = s.values.map((row, i) => [...row, s.token_mean[i], s.token_std[i], s.token_rms[i]]);
  rows.push([...s.feature_mean, NaN, NaN, NaN], [...s.feature_std, NaN, NaN, NaN]);
  const cols = [...s.values[0].map((_, j) => `f${j}`), "row mean", "row std", "row RMS"];
  const labels = [...s.values.map((_, i) => `t${i}`), "column mean", "column std"];
  const table = matrixTable(rows, { rowLabels: labels, colLabels: cols, id });
  return el("figure", {}, el("figcaption", {}, el("b", { text: title })), table);
}

const updateNorms = live(() => post("norms", { batch }), (a) => $("norm-outputs").replaceChildren(
  normFigure("input", "norm-in", a.input),
  normFigure("BatchNorm: each column mean 0, std 1", "norm-batch", a.batch),
  normFigure("LayerNorm: each row mean 0, std 1", "norm-layer", a.layer),
  normFigure("RMSNorm: each row RMS 1", "norm-rms", a.rms),
));

// Set up the positional-encoding and norms views.
export async function initPositions() {
  const positions = live(() => post("positions", {
    d_model: Number($("pe-dmodel").value), position: Number($("pe-position").value), offset: Number($("pe-offset").value),
    max_len: 160, // positions 0…99 plus offsets up to 50 stay inside the table
  }), drawPositions);
  $("pe-dmodel").addEventListener("change", positions);
  for (const id of ["pe-position", "pe-offset"]) {
    $(id).addEventListener("input", () => { $(`${id}-value`).textContent = $(id).value; positions(); });
  }
  const size = () => [batch.length, batch[0].length];
  $("norm-add-token").addEventListener("click", () => { const [r, c] = size(); resize(r + 1, c); });
  $("norm-remove-token").addEventListener("click", () => { const [r, c] = size(); resize(r - 1, c); });
  $("norm-add-feature").addEventListener("click", () => { const [r, c] = size(); resize(r, c + 1); });
  $("norm-remove-feature").addEventListener("click", () => { const [r, c] = size(); resize(r, c - 1); });
  batchTable();
  await Promise.all([positions(), updateNorms()]);
}
