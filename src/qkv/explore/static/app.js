// The page: six panels behind tabs, each set up by its own module.
import { getJSON, say } from "./common.js";
import { initFeatures } from "./features.js";
import { initInside } from "./inside.js";
import { initModel } from "./model.js";
import { initPositions } from "./positions.js";
import { initSheet } from "./sheet.js";
import { initWeights } from "./weights.js";

function showTab(name) {
  document.querySelectorAll("#tabs button").forEach((b) => b.classList.toggle("active", b.dataset.tab === name));
  document.querySelectorAll(".panel").forEach((p) => p.classList.toggle("active", p.id === name));
  history.replaceState(null, "", `#${name}`);
}

document.querySelectorAll("#tabs button").forEach((b) => b.addEventListener("click", () => showTab(b.dataset.tab)));
function showHashTab() {
  const name = location.hash.slice(1);
  if (document.getElementById(name)?.classList.contains("panel")) showTab(name);
}
window.addEventListener("hashchange", showHashTab);
showHashTab();

window.qkvExplore = { ready: false };
getJSON("/api/runs") // the runs the page may open, and the spreadsheet's classic table
  .then((runs) => { // `qkv explore SAE_RUN` opens the Features tab, unless the address names another
    const opened = runs.runs.find((r) => r.name === runs.default);
    if (opened && opened.task === "sae" && !location.hash) showTab("features");
    return runs;
  })
  .then((runs) => Promise.all([initSheet(runs.classic), initWeights(), initModel(runs), initPositions(), initInside(runs),
    initFeatures(runs)]))
  .then(() => { window.qkvExplore.ready = true; })
  .catch((err) => say(err.message, true));
