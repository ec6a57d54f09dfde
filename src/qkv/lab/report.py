"""`qkv lab report`: every experiment in one self-contained HTML page.

The figures are embedded as base64 data URIs and the style is inline, so report.html opens offline,
can be mailed as one file, and makes no network request (the page declares an empty favicon too,
so a browser does not even ask for /favicon.ico). The PNG files are written next to it.
"""

from __future__ import annotations

import base64
import html
import importlib
from collections.abc import Callable, Sequence
from datetime import datetime, timezone
from pathlib import Path

from qkv.lab.plotting import Section

REPORT_FILE = "report.html"
# The experiments that need no trained model, in the order the page shows them (induction trains its own small
# model, and leaves SmolLM2 to `qkv lab induction`).
EXPERIMENTS = ("variance", "softmax", "walkthrough", "positional", "norms", "masks", "heads", "induction")
STYLE = """
body { font-family: system-ui, -apple-system, 'Segoe UI', sans-serif; max-width: 72rem; margin: 2rem auto;
       padding: 0 1rem; color: #1d1d1f; line-height: 1.5; }
h1 { margin-bottom: 0.2rem; } .meta { color: #666; margin-top: 0; }
nav ol { columns: 2; } section { border-top: 1px solid #ddd; margin-top: 2rem; padding-top: 0.5rem; }
figure { margin: 1rem 0; } img { max-width: 100%; height: auto; border: 1px solid #eee; }
figcaption { color: #666; font-size: 0.85rem; }
pre { background: #f6f8fa; padding: 0.8rem; overflow-x: auto; font-size: 0.78rem; line-height: 1.35; }
.note { color: #8a6d3b; background: #fcf8e3; padding: 0.5rem 0.8rem; }
"""


def _data_uri(path: Path) -> str:
    """A PNG file as a data: URI, so the page needs no file beside it."""
    return "data:image/png;base64," + base64.b64encode(path.read_bytes()).decode("ascii")


def _section_html(number: int, section: Section) -> str:
    """One experiment: heading, paragraph, figures, tables."""
    parts = [f'<section id="{html.escape(section.name)}">',
             f"<h2>{number}. {html.escape(section.title)}</h2>",
             f"<p>{html.escape(section.explanation)}</p>"]  # fmt: skip
    for image in section.images:
        name = html.escape(image.name)
        parts.append(f'<figure><img src="{_data_uri(image)}" alt="{name}"><figcaption>{name}</figcaption></figure>')
    if not section.images and section.tables:
        parts.append(f'<p class="note">{html.escape(section.tables[0])}</p>')
        tables: Sequence[str] = section.tables[1:]
    else:
        tables = section.tables
    parts += [f"<pre>{html.escape(table)}</pre>" for table in tables]
    parts.append("</section>")
    return "\n".join(parts)


def render_html(sections: Sequence[Section], title: str = "qkv lab: attention, measured") -> str:
    """The whole page as a string."""
    stamp = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    toc = "\n".join(f'<li><a href="#{html.escape(s.name)}">{html.escape(s.title)}</a></li>' for s in sections)
    body = "\n".join(_section_html(i, s) for i, s in enumerate(sections, start=1))
    return f"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{html.escape(title)}</title>
<link rel="icon" href="data:,">
<style>{STYLE}</style>
</head>
<body>
<h1>{html.escape(title)}</h1>
<p class="meta">Written by <code>qkv lab report</code> on {stamp}. Every number below is recomputed by the
command; each experiment is also <code>qkv lab NAME</code> and a function in <code>qkv.lab</code>.</p>
<nav><ol>
{toc}
</ol></nav>
{body}
</body>
</html>
"""


def write_report(sections: Sequence[Section], out_dir: str | Path) -> Path:
    """Write report.html for these sections into out_dir; returns its path."""
    path = Path(out_dir) / REPORT_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(render_html(sections), encoding="utf-8")
    tmp.replace(path)
    return path


def build_report(
    out_dir: str | Path,
    run_dir: str | Path | None = None,
    text: str | None = None,
    progress: Callable[[Section], None] | None = None,
) -> Path:
    """Run every experiment with its defaults (attention maps only with a run), write PNGs and report.html."""
    out = Path(out_dir)
    attention = _attention_section(out, run_dir, text)  # first, so that a bad run directory fails fast
    sections = []
    for name in EXPERIMENTS:
        # import_module, not attribute access: qkv.lab.variance is the function, the module is in sys.modules.
        sections.append(importlib.import_module(f"qkv.lab.{name}").run(out))
        if progress is not None:
            progress(sections[-1])
    sections.append(attention)
    if progress is not None:
        progress(attention)
    return write_report(sections, out)


def _attention_section(out: Path, run_dir: str | Path | None, text: str | None) -> Section:
    """The attention-map experiment on a run, or a note saying how to include it."""
    from qkv.lab.attention_map import DEFAULT_TEXT, EXPLANATION, TITLE, run

    if run_dir is None:
        note = "Not included: pass --run RUN_DIR (a directory written by `qkv train`) to show a trained model's maps."
        return Section("attention-map", TITLE, EXPLANATION, [note], [])
    return run(out, run_dir, text or DEFAULT_TEXT)
