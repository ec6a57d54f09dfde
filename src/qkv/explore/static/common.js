// What every panel shares: the JSON API, number formatting, packed matrices and heat maps.

export const $ = (id) => document.getElementById(id);
const statusLine = () => $("status");

// An answer's JSON, or {} when it is none (a proxy's error page): the status then says which HTTP error.
async function answerOf(response) {
  return response.json().catch(() => ({}));
}

// Fetch a JSON answer; rejects with the server's one-line error.
async function request(path, init = {}) {
  const response = await fetch(path, init);
  const answer = await answerOf(response);
  if (!response.ok) throw new Error(answer.error || `HTTP ${response.status}`);
  return answer;
}

// POST a JSON body to /api/NAME.
export function post(name, body) {
  return request(`/api/${name}`, {
    method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(body),
  });
}

// GET a JSON answer.
export function getJSON(path) {
  return request(path);
}

// A live view: calls to update() while a request is on its way are merged into one follow-up request,
// and only the newest answer is drawn.
export function live(request, draw) {
  let running = false, again = false;
  const update = async () => {
    if (running) { again = true; return; }
    running = true;
    try {
      draw(await request());
      say("");
    } catch (err) {
      say(err.message, true);
    } finally {
      running = false;
      if (again) { again = false; update(); }
    }
  };
  return update;
}

// The status line at the top: the last error, or nothing.
export function say(message, isError = false) {
  const line = statusLine();
  line.textContent = message;
  line.classList.toggle("error", isError);
}

// A number for a cell: fixed point, or scientific when tiny or huge; masked scores as −∞.
export function fmt(value, digits = 4) {
  if (value === null || value === undefined) return "−∞"; // a masked score (JSON has no −∞)
  if (Number.isNaN(value)) return "";
  if (!Number.isFinite(value)) return value > 0 ? "∞" : "−∞";
  const size = Math.abs(value);
  if (size !== 0 && (size >= 1e5 || size < 10 ** -digits)) return value.toExponential(2);
  return value.toFixed(digits);
}

// A map's cell: two decimals (its exact value is in the title); nothing where it is not computed yet.
export function fixed2(value) {
  if (!Number.isFinite(value)) return "";
  return (Math.abs(value) < 0.005 ? 0 : value).toFixed(2); // no "−0.00"
}

// Token text made visible: spaces as ␣, line breaks as ↵.
export function showToken(token) {
  return token.replace(/ /g, "␣").replace(/\n/g, "↵").replace(/\t/g, "⇥") || "∅";
}

// A packed matrix {shape, data: base64 float32} as {shape, values: Float32Array}.
export function unpack(packed) {
  const bytes = Uint8Array.from(atob(packed.data), (c) => c.charCodeAt(0));
  return { shape: packed.shape, values: new Float32Array(bytes.buffer) };
}

// The (rows × cols) block at `offset` of a packed array's values, as an array of rows.
export function block(values, offset, rows, cols) {
  const out = [];
  for (let r = 0; r < rows; r++) out.push(Array.from(values.subarray(offset + r * cols, offset + (r + 1) * cols)));
  return out;
}

// A DOM element with attributes (class, text, on<event> handlers) and children.
export function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs)) {
    if (key === "class") node.className = value;
    else if (key === "text") node.textContent = value;
    else if (key.startsWith("on")) node.addEventListener(key.slice(2), value);
    else node.setAttribute(key, value);
  }
  node.append(...children);
  return node;
}

// Viridis, sampled at nine points and interpolated: dark purple (0) → yellow (1).
const VIRIDIS = [[68, 1, 84], [71, 44, 122], [59, 81, 139], [44, 113, 142], [33, 144, 141],
  [39, 173, 129], [92, 200, 99], [170, 220, 50], [253, 231, 37]];
// Red–white–blue for signed values.
export function colour(t, signed = false) {
  if (!Number.isFinite(t)) return "rgb(230,230,230)";
  if (signed) {
    const s = Math.max(-1, Math.min(1, t));
    const fade = Math.round(255 * (1 - Math.abs(s)));
    return s >= 0 ? `rgb(${255},${fade},${fade})` : `rgb(${fade},${fade},${255})`;
  }
  const x = Math.max(0, Math.min(1, t)) * (VIRIDIS.length - 1);
  const i = Math.min(Math.floor(x), VIRIDIS.length - 2), f = x - i;
  const [a, b] = [VIRIDIS[i], VIRIDIS[i + 1]];
  return `rgb(${a.map((v, k) => Math.round(v + f * (b[k] - v))).join(",")})`;
}

// Draw rows (arrays of numbers) on a canvas as coloured cells; values outside [lo, hi] are clipped.
// Non-finite values (masked scores) are drawn grey. Returns the cell size, for hit-testing.
export function heatmap(canvas, rows, { lo = 0, hi = 1, signed = false, labels = null } = {}) {
  const ctx = canvas.getContext("2d");
  const n = rows.length, m = rows[0] ? rows[0].length : 0;
  const margin = labels ? 70 : 0;
  const w = (canvas.width - margin) / Math.max(m, 1), h = (canvas.height - margin) / Math.max(n, 1);
  ctx.clearRect(0, 0, canvas.width, canvas.height);
  for (let r = 0; r < n; r++) {
    for (let c = 0; c < m; c++) {
      const v = rows[r][c];
      const t = signed ? v / Math.max(Math.abs(lo), Math.abs(hi), 1e-12) : (v - lo) / (hi - lo || 1);
      ctx.fillStyle = colour(t, signed);
      ctx.fillRect(margin + c * w, margin + r * h, Math.ceil(w), Math.ceil(h));
    }
  }
  if (labels) {
    ctx.fillStyle = "#222";
    ctx.font = `${Math.max(8, Math.min(13, h - 2))}px system-ui, sans-serif`;
    ctx.textAlign = "right"; ctx.textBaseline = "middle";
    labels.rows.forEach((label, r) => ctx.fillText(label, margin - 4, margin + (r + 0.5) * h));
    ctx.save();
    ctx.font = `${Math.max(8, Math.min(13, w - 2))}px system-ui, sans-serif`;
    labels.cols.forEach((label, c) => {
      ctx.save(); ctx.translate(margin + (c + 0.5) * w, margin - 4); ctx.rotate(-Math.PI / 2);
      ctx.textAlign = "left"; ctx.fillText(label, 0, 0); ctx.restore();
    });
    ctx.restore();
  }
  return { margin, w, h, n, m };
}

// A table of numbers with row and column labels; each cell keeps its exact value in data-value, shows
// format(v), and title(v, r, c), when given, says what the cell is on hover.
export function matrixTable(rows, { rowLabels = null, colLabels = null, digits = 3, heat = null, id = null,
  title = null, format = (v) => fmt(v, digits) } = {}) {
  const table = el("table", { class: "matrix", ...(id ? { id } : {}) });
  if (colLabels) table.append(el("tr", {}, el("th"), ...colLabels.map((c) => el("th", { text: c }))));
  rows.forEach((row, r) => {
    const tr = el("tr", {}, el("th", { text: rowLabels ? rowLabels[r] : String(r) }));
    row.forEach((v, c) => {
      const td = el("td", { text: format(v), "data-value": v === null ? "-Infinity" : String(v) });
      if (title) td.title = title(v, r, c);
      if (heat) {
        td.style.background = colour(heat(v), heat.signed);
        if (!heat.signed && heat(v) < 0.55) td.style.color = "#fff"; // dark viridis cells
        if (heat.signed && Math.abs(heat(v)) > 0.6) td.style.color = "#fff"; // deep red or blue cells
      }
      tr.append(td);
    });
    table.append(tr);
  });
  return table;
}

// A table cell's number input: marks itself red while it does not hold a number, else calls onNumber(value).
export function numberInput(value, attrs, onNumber) {
  const input = el("input", { class: "cell", value: String(value), inputmode: "decimal", size: 6, ...attrs });
  input.addEventListener("input", () => {
    const number = Number(input.value);
    const ok = input.value.trim() !== "" && Number.isFinite(number) && Math.abs(number) <= 1e6;
    input.classList.toggle("bad", !ok);
    input.title = ok ? "" : "a number between −1,000,000 and 1,000,000";
    if (ok) onNumber(number);
  });
  return input;
}

// fn, called once typing pauses for `ms` milliseconds.
export function debounce(fn, ms = 120) {
  let timer = null;
  return (...args) => { clearTimeout(timer); timer = setTimeout(() => fn(...args), ms); };
}
