// Panel 6: an SAE's features (qkv.sae.features). A text's latents token by token; a latent's dashboard, whose
// top contexts the server searches for in the validation split one batch of windows at a time while the page
// polls /api/feature_status, drawing what is found so far; and steering with the latent's decoder direction.
// Every request names the hook the opened SAE reads: the server refuses an answer from anywhere else.
import { $, debounce, el, fmt, live, post, say, showToken } from "./common.js";

const POLL_MS = 150;
// ticket: each dashboard or steering request takes a new one; an answer whose ticket is no longer the latest (the
// user asked again, or opened another SAE meanwhile) is dropped, and its dashboard stopped.
const state = { run: null, info: null, job: null, stale: true, ticket: 0 };

const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));

function visible() {
  return $("features").classList.contains("active");
}

// Orange, as strong as the activation is against the largest one shown.
function shade(value, top) {
  return value > 0 ? `rgba(253, 141, 60, ${Math.min(1, value / top).toFixed(3)})` : "";
}

// A typed number as a number; anything else as typed, so that the server's one-line refusal says what is wrong.
function numberOr(text) {
  return text.trim() !== "" && Number.isFinite(Number(text)) ? Number(text) : text;
}

function drawTokens(a) {
  if (a.run !== state.run) return;
  // Positions training left out (the first one, the attention sink, has activations many times the others'):
  // shown, but greyed and not counted in the shading's scale.
  const top = Math.max(1e-9, ...a.latents.filter((_, i) => a.trained[i]).flat().map(([, v]) => v));
  const chip = ([latent, value]) => {
    const button = el("button", { class: "latent", "data-latent": latent, "data-value": String(value),
      title: `latent ${latent}: activation ${fmt(value, 4)}; click for its dashboard`, text: `${latent} ${fmt(value, 2)}`,
      onclick: () => {
        $("feat-latent").value = String(latent);
        $("feat-latent-view").scrollIntoView({ block: "start" }); // the dashboard is below the table
        openLatent();
      } });
    button.style.background = shade(Math.min(value, top), top);
    return button;
  };
  const rows = a.tokens.map((token, i) => el("tr", { "data-pos": i, class: a.trained[i] ? "" : "untrained",
    title: a.trained[i] ? "" : "training left this position out (the first of a window, BOS, or an outlying norm): " +
      "its latents are not what the SAE learned to read" }, el("th", { text: showToken(token) }),
    el("td", {}, ...(a.latents[i].length ? a.latents[i].map(chip) : [el("span", { class: "note", text: "none active" })]))));
  $("feat-tokens").replaceChildren(el("tr", {}, el("th", { text: "token" }),
    el("th", { text: "most active latents: latent activation" })), ...rows);
  $("feat-tokens").dataset.text = a.text;
}

const refreshTokens = live(async () => {
  const run = state.run, text = $("feat-text").value, info = state.info;
  if (!info) return { run: null }; // the SAE changed while this waited: nothing to draw
  try {
    return { ...(await post("features", { run, hook: info.hook, text })), run, text };
  } catch (err) { // refused: the table of the last text would pass for this one's
    if (run === state.run) { $("feat-tokens").replaceChildren(); delete $("feat-tokens").dataset.text; }
    throw err;
  }
}, drawTokens);

function drawPromoted(meta) {
  const row = ([id, value, text]) => el("tr", { "data-id": id, "data-value": String(value) },
    el("td", { text: `“${showToken(text)}”` }), el("td", { class: "shape", text: `${value >= 0 ? "+" : ""}${fmt(value, 3)}` }));
  $("feat-promoted").replaceChildren(el("tr", {}, el("th", { text: "promotes" }), el("th", { text: "logit" })),
    ...meta.promoted.map(row), el("tr", {}, el("th", { text: "demotes" }), el("th", { text: "logit" })),
    ...meta.demoted.map(row));
}

function drawContexts(meta, snap) {
  const top = Math.max(1e-9, ...snap.contexts.map((c) => c.value));
  $("feat-contexts").replaceChildren(...snap.contexts.map((c) => el("li", {
    "data-value": String(c.value), "data-at": c.at, "data-ids": c.ids.join(","), "data-values": c.values.join(","),
  }, el("span", { class: "act", text: fmt(c.value, 3) }), ...c.ids.map((id, i) => {
    const label = `“${showToken(snap.pieces[String(id)])}” activation ${fmt(c.values[i], 4)}`;
    const span = el(i === c.at ? "mark" : "span", { class: i === c.at ? "tok at" : "tok", title: label,
      "aria-label": label, text: showToken(snap.pieces[String(id)]) });
    span.style.background = shade(c.values[i], top);
    return span;
  }))));
  if (!snap.contexts.length && snap.state === "done") {
    $("feat-contexts").replaceChildren(el("li", { class: "note", text: `it never fired in ${meta.windows} windows` }));
  }
  const progress = $("feat-progress");
  progress.max = snap.total;
  progress.value = snap.done;
  progress.qkvHistory.push([snap.done, snap.total, snap.contexts.length]); // for the tests
  const end = { done: "done", cancelled: "stopped", failed: "failed", running: "searching" }[snap.state];
  $("feat-progress-info").textContent = `latent ${meta.latent}: ${snap.done} of ${snap.total} batches of held-out ` +
    `windows (${meta.windows} in all) · ${end}`;
  $("feat-progress-info").dataset.latent = meta.latent;
  $("feat-progress-info").dataset.state = snap.state;
}

async function poll(meta) {
  while (state.job === meta.job) {
    const snap = await post("feature_status", { job: meta.job });
    if (state.job !== meta.job) return null; // replaced or stopped meanwhile
    drawContexts(meta, snap);
    if (snap.state !== "running") return snap;
    await sleep(POLL_MS);
  }
  return null;
}

function showStopped() {
  const line = $("feat-progress-info");
  if (line.dataset.state !== "running") return;
  line.textContent = line.textContent.replace(/ · searching$/, " · stopped");
  line.dataset.state = "cancelled";
}

async function stopDashboard() {
  const job = state.job;
  state.job = null;
  state.ticket += 1; // an answer on its way is now stale
  $("feat-cancel").disabled = true;
  $("feat-open").disabled = false;
  showStopped();
  if (job) await post("feature_cancel", { job }).catch(() => null); // it may have finished meanwhile
}

// A request of the current SAE and ticket: {ticket, run, hook}, or null (with the reason said) when none is open.
function ticketed() {
  if (!state.info) { say("the SAE is still opening (or could not be opened): wait, or choose another", true); return null; }
  state.ticket += 1;
  return { ticket: state.ticket, run: state.run, hook: state.info.hook };
}

const current = (t) => t.ticket === state.ticket && t.run === state.run;

async function openLatent() {
  await stopDashboard();
  const t = ticketed();
  if (!t) return;
  $("feat-open").disabled = true;
  try {
    const meta = await post("feature", { run: t.run, hook: t.hook, latent: numberOr($("feat-latent").value) });
    if (!current(t)) { post("feature_cancel", { job: meta.job }).catch(() => null); return; } // superseded
    state.job = meta.job;
    $("feat-cancel").disabled = false;
    $("feat-progress").qkvHistory = [];
    drawPromoted(meta);
    drawContexts(meta, { state: "running", done: 0, total: meta.total, contexts: [], pieces: {} });
    const end = await poll(meta);
    if (end && end.error) say(end.error, true);
    else if (end) say("");
  } catch (err) {
    if (current(t)) say(err.message, true);
  } finally {
    if (current(t)) {
      $("feat-open").disabled = false;
      $("feat-cancel").disabled = true;
    }
  }
}

async function steer() {
  const t = ticketed();
  if (!t) return;
  const body = { run: t.run, hook: t.hook, latent: numberOr($("feat-latent").value),
    alpha: numberOr($("steer-alpha").value), prompt: $("steer-prompt").value,
    max_new_tokens: numberOr($("steer-tokens").value) };
  $("steer-run").disabled = true;
  try {
    const a = await post("steer", body);
    if (t.run !== state.run) return; // another SAE was opened meanwhile
    $("steer-plain").textContent = a.prompt + a.plain;
    $("steer-steered").textContent = a.prompt + a.steered;
    $("steer-label").textContent = `steered: latent ${a.latent}, α = ${a.alpha}`;
    Object.assign($("steer-steered").dataset, { latent: a.latent, alpha: a.alpha, text: a.steered });
    $("steer-plain").dataset.text = a.plain;
    say("");
  } catch (err) {
    if (t.run === state.run) say(err.message, true);
  } finally {
    $("steer-run").disabled = false;
  }
}

function refresh() {
  if (!state.info) return;
  if (!visible()) { state.stale = true; return; }
  state.stale = false;
  refreshTokens();
}

async function openRun(name) {
  await stopDashboard();
  state.run = name;
  state.info = null;
  delete $("feat-info").dataset.run;
  $("feat-info").textContent = "opening the SAE and the model it reads …";
  for (const id of ["feat-tokens", "feat-contexts", "feat-promoted"]) $(id).replaceChildren();
  for (const id of ["steer-plain", "steer-steered", "feat-progress-info"]) $(id).textContent = "";
  for (const id of ["steer-plain", "steer-steered", "feat-progress-info"]) delete $(id).dataset.text;
  delete $("feat-progress-info").dataset.state;
  $("steer-label").textContent = "steered";
  $("feat-progress").value = 0;
  let info;
  try {
    info = await post("sae", { run: name });
  } catch (err) {
    if (state.run === name) { $("feat-info").textContent = err.message; say(err.message, true); }
    return;
  }
  if (state.run !== name) return;
  state.info = info;
  $("feat-info").textContent = `${info.architecture} SAE · ${info.latents.toLocaleString()} latents` +
    `${info.architecture === "relu" ? "" : ` · k ${info.k}`} · reads ${info.hook} (width ${info.d_model}) of ${info.model}`;
  $("feat-info").dataset.run = name;
  $("feat-info").dataset.hook = info.hook;
  $("feat-latent").max = String(info.latents - 1);
  if (info.norm) { // α is added to activations of about this norm: start steering at half of it
    $("steer-norm").textContent = ` The activations here have a mean norm of ${info.norm.toPrecision(3)}; α is in ` +
      "those units.";
    if (!$("steer-alpha").dataset.edited) $("steer-alpha").value = String(Number((info.norm / 2).toPrecision(2)));
  }
  state.stale = true;
  refresh();
}

// Set up the panel on the SAE runs the server offers ({runs, default}). Opening an SAE reads its model: that
// waits until the tab is first shown, so that a page opened for another tab never pays for it.
export async function initFeatures({ runs, default: preferred }) {
  const saes = runs.filter((r) => r.task === "sae");
  $("feat-empty").hidden = saes.length > 0;
  $("feat-body").hidden = saes.length === 0;
  $("feat-progress").qkvHistory = [];
  if (saes.length === 0) return;
  $("feat-run").replaceChildren(...saes.map((r) => el("option", { value: r.name, text: r.name })));
  $("feat-run").addEventListener("change", (e) => openRun(e.target.value));
  $("feat-text").addEventListener("input", debounce(() => { if (state.info && visible()) refreshTokens(); }, 200));
  $("feat-open").addEventListener("click", openLatent);
  $("feat-latent").addEventListener("keydown", (e) => { if (e.key === "Enter" && !$("feat-open").disabled) openLatent(); });
  $("feat-cancel").addEventListener("click", stopDashboard);
  $("steer-run").addEventListener("click", steer);
  $("steer-alpha").addEventListener("input", () => { $("steer-alpha").dataset.edited = "1"; });
  const first = saes.find((r) => r.name === preferred) || saes[0];
  $("feat-run").value = first.name;
  const shown = () => {
    if (!visible()) return;
    if (state.run === null) openRun($("feat-run").value);
    else if (state.stale) refresh();
  };
  new MutationObserver(shown).observe($("features"), { attributes: true, attributeFilter: ["class"] });
  if (visible()) await openRun(first.name);
}
