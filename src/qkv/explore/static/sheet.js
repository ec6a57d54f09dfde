// Panel 1: the attention spreadsheet. The table is the page's state; every edit asks the server
// (qkv.lab.walkthrough) for every stage again, and the answer is drawn below the embeddings.
import { $, colour, el, fmt, live, numberInput, post } from "./common.js";

const state = { words: [], embeddings: [], query: 0 };
let classic = null;

function scaleFactor() { return Number($("sheet-scale").value); }

function request() {
  return post("spreadsheet", {
    words: state.words, embeddings: state.embeddings, query: state.query,
    sqrt_scale: $("sheet-sqrt").checked, factor: scaleFactor(),
  });
}

function headerRow() {
  const tr = el("tr", {}, el("th", { text: "word →" }));
  state.words.forEach((word, i) => {
    const input = el("input", { class: "word", value: word, "data-word": i, size: Math.max(3, word.length) });
    input.addEventListener("change", () => {
      if (!input.value.trim()) { input.value = state.words[i]; return; }
      state.words[i] = input.value.trim(); build();
    });
    const remove = el("button", { class: "remove", title: "remove this word", text: "×" });
    remove.addEventListener("click", () => removeWord(i));
    tr.append(el("th", { class: i === state.query ? "query" : "" }, input, state.words.length > 1 ? remove : ""));
  });
  tr.append(el("th", { class: "result", text: "new vector" }));
  return tr;
}

function embeddingRow(dim) {
  const tr = el("tr", {}, el("th", { text: `x${dim + 1}` }));
  state.embeddings.forEach((vector, i) => {
    const input = numberInput(vector[dim], { "data-word": i, "data-dim": dim }, (value) => {
      state.embeddings[i][dim] = value;
      update();
    });
    tr.append(el("td", { class: i === state.query ? "query" : "" }, input));
  });
  tr.append(el("td", { class: "result" }));
  return tr;
}

function resultRow(id, label, title) {
  const tr = el("tr", { id, class: "stage", title }, el("th", { text: label }));
  state.words.forEach((_, i) => tr.append(el("td", { class: i === state.query ? "query" : "" })));
  tr.append(el("td", { class: "result" }));
  return tr;
}

function build() {
  const table = $("sheet-table");
  const d = state.embeddings[0].length;
  table.replaceChildren(headerRow());
  for (let j = 0; j < d; j++) table.append(embeddingRow(j));
  table.append(resultRow("sheet-dots", "q · k", "inner product of the query word's vector with each word's"));
  table.append(resultRow("sheet-scores", "score", "q · k × the scale"));
  table.append(resultRow("sheet-exps", "exp(score)", "exponential of the score"));
  table.append(resultRow("sheet-weights", "weight", "exp(score) / Σ exp(score): sums to 1"));
  for (let j = 0; j < d; j++) table.append(resultRow(`sheet-weighted-${j}`, `weight × x${j + 1}`, ""));
  const select = $("sheet-query");
  select.replaceChildren(...state.words.map((w, i) => el("option", { value: i, text: `${i + 1}. ${w}` })));
  select.value = String(state.query);
  update();
}

function fill(id, values, digits = 4, heat = null) {
  const cells = $(id).querySelectorAll("td:not(.result)");
  values.forEach((v, i) => {
    cells[i].textContent = fmt(v, digits);
    cells[i].dataset.value = String(v);
    cells[i].style.background = heat ? colour(heat(v)) : "";
    cells[i].style.color = heat && heat(v) < 0.55 ? "#fff" : "";
  });
}

function draw(answer) {
  const shapeNow = answer.words.length === state.words.length && answer.context.length === state.embeddings[0].length;
  if (!shapeNow) return; // the table changed while this answer was on its way; the next one will match
  fill("sheet-dots", answer.dot_products);
  fill("sheet-scores", answer.scores);
  fill("sheet-exps", answer.exp_scores);
  fill("sheet-weights", answer.weights, 4, (v) => v);
  const d = answer.context.length;
  for (let j = 0; j < d; j++) {
    fill(`sheet-weighted-${j}`, answer.weighted.map((row) => row[j]));
    const result = $(`sheet-weighted-${j}`).querySelector("td.result");
    result.textContent = fmt(answer.context[j]);
    result.dataset.value = String(answer.context[j]);
    result.title = `before: ${fmt(answer.before[j])}`;
  }
  $("sheet-maxprob").textContent = fmt(answer.max_prob, 6);
  $("sheet-entropy").textContent = fmt(answer.entropy, 4);
  $("sheet-jacobian").textContent = fmt(answer.jacobian_norm, 6);
  $("sheet-applied").textContent = `× ${fmt(answer.scale, 4)}`;
}

const update = live(request, draw);

function removeWord(i) {
  state.words.splice(i, 1);
  state.embeddings.splice(i, 1);
  if (state.query >= state.words.length) state.query = state.words.length - 1;
  else if (i < state.query) state.query -= 1;
  build();
}

function addWord() {
  const d = state.embeddings[0].length;
  state.words.push(`word${state.words.length + 1}`);
  state.embeddings.push(Array(d).fill(0));
  build();
}

function reset() {
  state.words = [...classic.words];
  state.embeddings = classic.embeddings.map((v) => [...v]);
  state.query = classic.query;
  build();
}

// Set up the panel on the classic table ({words, embeddings, query}).
export async function initSheet(table) {
  classic = table;
  $("sheet-query").addEventListener("change", (e) => { state.query = Number(e.target.value); build(); });
  $("sheet-add-word").addEventListener("click", addWord);
  $("sheet-reset").addEventListener("click", reset);
  $("sheet-sqrt").addEventListener("change", update);
  $("sheet-scale").addEventListener("input", () => {
    $("sheet-scale-value").textContent = String(scaleFactor());
    update();
  });
  reset();
}
