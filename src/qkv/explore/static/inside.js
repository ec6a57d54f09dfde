// Panel 5: inside the model (qkv.interpret). The logit lens of a typed prompt and every head's induction and
// previous-token scores on repeated random tokens; activation patching is in patch.js. Nothing is computed until
// the panel is shown: on a real model the head scores take seconds, and the other panels come first.
import { $, colour, debounce, el, fixed2, fmt, live, matrixTable, post, say, showToken } from "./common.js";
import { initPatching, openPatching } from "./patch.js";

const TASKS = ["lm", "mlm"]; // runs that read one text; a translation reads two
const state = { run: null, info: null, stale: true };

function visible() {
  return $("inside").classList.contains("active");
}

// Each answer remembers the run it was asked for: one for a run chosen before is not drawn.
function forRun(name, body) {
  return async () => {
    const run = state.run;
    return { ...(await post(name, { run, ...body() })), run };
  };
}

function lensCell(a, row, col) {
  const ids = a.top_ids[row][col], probs = a.top_probs[row][col];
  const piece = (id) => showToken(a.pieces[String(id)]);
  const lines = ids.map((id, k) => `${k + 1}. “${piece(id)}”  ${fmt(probs[k], 4)}`);
  const td = el("td", {
    class: "lens-cell", "data-row": row, "data-col": col, "data-id": ids[0], "data-prob": String(probs[0]),
    "data-top-ids": ids.join(","), "data-top-probs": probs.map(String).join(","),
    title: `${a.labels[row]}, at “${showToken(a.tokens[col])}” (position ${col}):\n${lines.join("\n")}`,
  }, el("span", { class: "tok", text: piece(ids[0]) }), el("span", { class: "p", text: probs[0].toFixed(2) }));
  td.style.background = colour(probs[0]);
  if (probs[0] < 0.55) td.style.color = "#fff"; // dark viridis cells
  return td;
}

function drawLens(a) {
  if (a.run !== state.run) return;
  const masked = state.info && state.info.task === "mlm"; // it predicts each position's own token
  $("lens-note").textContent = a.note + (masked ? "; a masked LM predicts the token at each position, not the next" : "");
  $("lens-note").classList.toggle("warn", !a.final_norm);
  const header = el("tr", {}, el("th", { text: "stream \\ token" }),
    ...a.tokens.map((t, c) => el("th", { text: showToken(t), title: `position ${c}` })));
  $("lens-grid").replaceChildren(header, ...a.labels.map((label, r) => el("tr", {}, el("th", { text: label }),
    ...a.tokens.map((_, c) => lensCell(a, r, c)))));
}

function scoreTable(id, rows, what) {
  const heat = (v) => v; // a share of attention: 0 to 1
  const table = matrixTable(rows, { rowLabels: rows.map((_, l) => `layer ${l}`), colLabels: rows[0].map((_, h) => `H${h}`),
    format: fixed2, heat, id, title: (v, l, h) => `layer ${l}, head ${h}: ${what} score ${fmt(v, 4)}` });
  table.classList.add("heat");
  $(id).replaceWith(table);
}

function drawHeads(a) {
  if (a.run !== state.run) return;
  scoreTable("heads-induction", a.induction, "induction");
  scoreTable("heads-previous", a.previous, "previous-token");
  $("heads-top").replaceChildren(...a.top.map((t) => el("li", {
    "data-layer": t.layer, "data-head": t.head, "data-value": String(t.induction),
    text: `L${t.layer}.H${t.head}: induction ${fmt(t.induction, 3)}, previous-token ${fmt(t.previous, 3)}`,
  })));
  if (!$("heads-length").value) $("heads-length").value = String(a.length);
  $("heads-info").textContent = `${a.batch} × ${a.length} random tokens of ids ${a.low}–${a.high - 1}, then the same ` +
    `again: “${a.example.map(showToken).join(" ")} …”`;
}

function headsBody() {
  const length = $("heads-length").value;
  return { seed: Number($("heads-seed").value), batch: Number($("heads-batch").value),
    ...(length ? { length: Number(length) } : {}) };
}

const refreshLens = live(forRun("lens", () => ({ text: $("lens-text").value })), drawLens);
const refreshHeads = live(forRun("heads", headsBody), drawHeads);

// Compute the views when the panel is on screen; otherwise mark them to be computed when it is shown.
function refresh() {
  if (!state.info) return;
  if (!visible()) { state.stale = true; return; }
  state.stale = false;
  refreshLens();
  refreshHeads();
}

async function openRun(name) {
  state.run = name;
  state.info = null;
  $("inside-info").textContent = "";
  delete $("inside-info").dataset.run;
  openPatching(name);
  const info = await post("model", { run: name });
  if (state.run !== name) return; // another run was chosen meanwhile
  state.info = info;
  $("inside-info").textContent = `${info.task} · ${info.n_layers} layers · ${info.n_heads} heads · context ${info.max_positions}`;
  $("inside-info").dataset.run = name;
  $("patch-view").hidden = !info.causal; // patching reads the next token at a prompt's end: language models only
  $("heads-length").value = "";
  $("lens-grid").replaceChildren();
  refresh();
}

// Set up the panel on the runs the server offers ({runs, default}) that read one text.
export async function initInside({ runs, default: preferred }) {
  const usable = runs.filter((r) => TASKS.includes(r.task));
  $("inside-empty").hidden = usable.length > 0;
  $("inside-body").hidden = usable.length === 0;
  if (usable.length === 0) return;
  $("inside-run").replaceChildren(...usable.map((r) => el("option", { value: r.name, text: `${r.name} (${r.task})` })));
  $("inside-run").addEventListener("change", (e) => openRun(e.target.value).catch((err) => say(err.message, true)));
  $("lens-text").addEventListener("input", debounce(() => { if (state.info && visible()) refreshLens(); }, 200));
  for (const id of ["heads-seed", "heads-length", "heads-batch"]) {
    $(id).addEventListener("change", () => { if (state.info && visible()) refreshHeads(); });
  }
  // Shown by its tab or by the address's #inside: compute what changed while it was hidden.
  new MutationObserver(() => { if (visible() && state.stale) refresh(); })
    .observe($("inside"), { attributes: true, attributeFilter: ["class"] });
  initPatching(() => state.run);
  const first = usable.find((r) => r.name === preferred) || usable[0];
  $("inside-run").value = first.name;
  await openRun(first.name);
}
