// Activation patching (qkv.interpret.activation_patching). POST /api/patching checks the prompts and starts the
// map; the server computes it one layer (one batched forward pass) at a time, and the page polls
// /api/patching_status, drawing each row as it arrives, with a progress bar.
import { $, el, fixed2, fmt, matrixTable, post, say, showToken } from "./common.js";

const POLL_MS = 100;
const state = { run: () => null, job: null };

const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));

// Red (restores the clean answer) – white (0) – blue (pushes towards the wrong one), symmetric about 0.
function signedHeat(rows) {
  const top = Math.max(1, ...rows.flat().filter(Number.isFinite).map(Math.abs));
  const heat = (v) => v / top;
  heat.signed = true;
  heat.top = top;
  return heat;
}

function mapTable(id, rows, rowLabels, colLabels, heat, what) {
  const table = matrixTable(rows, { rowLabels, colLabels, format: fixed2, heat, id,
    title: (v, r, c) => (Number.isFinite(v) ? `layer ${r}, ${what(c)}: effect ${fmt(v, 4)}` : `layer ${r}: not computed yet`) });
  table.classList.add("heat");
  $(id).replaceWith(table);
}

function draw(meta, snap) {
  const n = meta.n_layers, t = meta.clean_tokens.length;
  const fill = (rows, width) => Array.from({ length: n }, (_, l) => rows[l] || new Array(width).fill(NaN));
  const cols = meta.clean_tokens.map((c, i) => (c === meta.corrupted_tokens[i] ? showToken(c)
    : `${showToken(c)} / ${showToken(meta.corrupted_tokens[i])}`));
  const layers = Array.from({ length: n }, (_, l) => `layer ${l}`);
  const heat = signedHeat([...snap.resid, ...snap.heads]);
  mapTable("patch-resid", fill(snap.resid, t), layers, cols, heat, (c) => `position ${c} (${cols[c]})`);
  const heads = meta.heads ? fill(snap.heads, meta.n_heads) : [];
  mapTable("patch-heads-map", heads, layers, Array.from({ length: meta.n_heads }, (_, h) => `H${h}`), heat,
    (c) => `head ${c}`);
  const progress = $("patch-progress");
  progress.max = snap.total;
  progress.value = snap.done;
  progress.qkvHistory.push([snap.done, snap.total, snap.resid.length, snap.heads.length]); // for the tests
  const end = { done: "done", cancelled: "stopped", failed: "failed", running: "computing" }[snap.state];
  $("patch-info").textContent = `${snap.done} of ${snap.total} forward passes · ${end}`;
  $("patch-legend").replaceChildren(el("span", { class: "neg", text: `−${fmt(heat.top, 2)}` }),
    el("span", { class: "zero", text: "0: no change" }), el("span", { class: "pos", text: `+${fmt(heat.top, 2)}` }),
    el("span", { text: "  1 = restores the clean answer" }));
}

function showMetric(meta) {
  const line = $("patch-metric");
  line.textContent = `metric: logit[“${showToken(meta.answer.text)}”] − logit[“${showToken(meta.wrong.text)}”] = ` +
    `${fmt(meta.clean, 3)} on the clean prompt, ${fmt(meta.corrupted, 3)} on the corrupted one`;
  Object.assign(line.dataset, { answer: meta.answer.id, wrong: meta.wrong.id, clean: meta.clean, corrupted: meta.corrupted });
}

async function poll(meta) {
  while (state.job === meta.job) {
    const snap = await post("patching_status", { job: meta.job });
    if (state.job !== meta.job) return; // replaced or stopped meanwhile
    draw(meta, snap);
    if (snap.state !== "running") return snap;
    await sleep(POLL_MS);
  }
  return null; // stopped from the page
}

async function stop() {
  const job = state.job;
  state.job = null;
  $("patch-cancel").disabled = true;
  $("patch-run").disabled = false;
  if (!job) return;
  $("patch-info").textContent = `${$("patch-info").textContent.split(" · ")[0]} · stopped`;
  await post("patching_cancel", { job }).catch(() => null); // it may have finished meanwhile
}

async function start() {
  await stop();
  const text = (id) => $(id).value || null; // empty: the server picks the prompt's top next token
  const body = { run: state.run(), clean: $("patch-clean").value, corrupted: $("patch-corrupted").value,
    answer: text("patch-answer"), wrong: text("patch-wrong"), heads: $("patch-heads").checked };
  $("patch-run").disabled = true;
  try {
    const meta = await post("patching", body);
    state.job = meta.job;
    $("patch-cancel").disabled = false;
    $("patch-progress").qkvHistory = [];
    showMetric(meta);
    draw(meta, { state: "running", done: 0, total: meta.total, resid: [], heads: [] });
    const end = await poll(meta);
    if (end && end.error) say(end.error, true); // the model failed mid-map: say why
    else say("");
  } catch (err) {
    say(err.message, true);
  } finally { // the map ended, was stopped, or was refused
    $("patch-run").disabled = false;
    $("patch-cancel").disabled = true;
  }
}

// Another run was opened: stop its map and clear the view.
export function openPatching() {
  stop();
  for (const id of ["patch-resid", "patch-heads-map", "patch-legend"]) $(id).replaceChildren();
  $("patch-metric").textContent = "";
  $("patch-info").textContent = "";
  $("patch-progress").value = 0;
}

// Set up the patching view; run() names the run it patches.
export function initPatching(run) {
  state.run = run;
  $("patch-progress").qkvHistory = [];
  $("patch-run").addEventListener("click", start);
  $("patch-cancel").addEventListener("click", stop);
}
