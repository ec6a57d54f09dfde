"""The runs the explorer may open: RUN_DIR and the run directories under runs/, nothing outside them. With --lm (and
--data), SAELens directories among them open too, read on that model.

Creating a library reads nothing: the server listens before torch is imported, and the first request that
needs a run reads its config.json (in any layout qkv.io.run_dir migrates) and, later, its weights.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qkv.errors import QkvError

TASKS = ("lm", "translate", "mlm")  # the tasks whose runs read text (copy and reverse use digit vocabularies)
SAE_TASK = "sae"  # an SAE run, read on the language model it records (the Features tab)
SEARCH_DEPTH = 3  # how deep under runs/ the explorer looks for run directories


class RequestError(QkvError):
    """A request the explorer refuses, with the HTTP status that says why (404 unknown, 403 not allowed)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class RunInfo:
    """One run the page can open: its name in requests, its task and its directory."""

    name: str
    task: str
    path: Path


class RunLibrary:
    """The run directories the explorer serves (RUN_DIR and those under runs/), loaded once each, on first use."""

    def __init__(self, run_dir: Path | None, search: Path, checkpoint: str = "best", lm: str | None = None,
                 data: str | None = None) -> None:  # fmt: skip
        self.lm, self.data = lm, data  # the model and data SAELens directories are read with (their format has none)
        self.base = Path.cwd().resolve()
        self.search = search.resolve()
        self.roots = [self.search] + ([run_dir.resolve()] if run_dir is not None else [])
        self.checkpoint = checkpoint
        self.run_dir = run_dir.resolve() if run_dir is not None else None
        self._loaded: dict[Path, Any] = {}
        self._infos: dict[Path, RunInfo | None] = {}  # what each directory's config.json said, read once
        self._lock = threading.Lock()

    @property
    def default(self) -> RunInfo | None:
        """The run named on the command line, when it is one the page can open."""
        return self._info(self.run_dir) if self.run_dir is not None else None

    def _name(self, path: Path) -> str:
        """How a run is named on the page and in requests: relative to the working directory when inside it."""
        return str(path.relative_to(self.base)) if path.is_relative_to(self.base) else str(path)

    def _info(self, path: Path) -> RunInfo | None:
        """The run (or language-model checkpoint) at `path`, or None when it is none of a task with text (read
        once)."""
        from qkv.tasks.checkpoint import model_task  # imports torch: not before the server listens
        from qkv.tasks.sae_open import is_saelens

        if path not in self._infos and self.lm is not None and is_saelens(path):
            self._infos[path] = RunInfo(self._name(path), SAE_TASK, path)
        if path not in self._infos:
            try:
                task: str | None = model_task(path)
            except (QkvError, OSError, KeyError):
                task = None
            self._infos[path] = RunInfo(self._name(path), task, path) if task in (*TASKS, SAE_TASK) else None
        return self._infos[path]

    def available(self) -> list[RunInfo]:
        """Every run the page may open: RUN_DIR first, then the runs found under the search directory."""
        found = [self.default] if self.default is not None else []
        for directory in _run_dirs(self.search, SEARCH_DEPTH):
            info = self._info(directory)
            if info is not None and info not in found:
                found.append(info)
        return found

    def resolve(self, name: str) -> RunInfo:
        """The run a request names, refused when outside the served directories (403) or not a run (404)."""
        if "\x00" in name:
            raise RequestError(400, "a run name cannot contain a NUL character")
        path = Path(name) if Path(name).is_absolute() else self.base / name
        path = path.resolve()
        if not any(path.is_relative_to(root) for root in self.roots):
            raise RequestError(403, f"{name!r} is outside the directories the explorer serves "
                                    f"({', '.join(self._name(r) for r in self.roots)})")  # fmt: skip
        info = self._info(path)
        if info is None:
            raise RequestError(404, f"no run named {name!r}: it is not a run of a task with text, nor a checkpoint "
                                    "of a language model")  # fmt: skip
        return info

    def load(self, name: str, tasks: tuple[str, ...] = (*TASKS, SAE_TASK)) -> Any:
        """The loaded run (qkv.tasks.load) a request names, of one of `tasks`; each run is read from disk once."""
        info = self.resolve(name)
        if info.task not in tasks:
            wanted = "an SAE run" if tasks == (SAE_TASK,) else "a run of a model that reads text"
            raise RequestError(400, f"{name!r} is a {info.task} run; this view opens {wanted}")
        with self._lock:
            if info.path not in self._loaded:
                try:
                    self._loaded[info.path] = self._read(info.path)
                except QkvError:
                    raise
                except Exception as err:  # a damaged run: its files, not the request, are at fault
                    raise RequestError(422, f"cannot read the run {name!r}: its files are damaged or incomplete; "
                                            "open another run") from err  # fmt: skip
            return self._loaded[info.path]

    def _read(self, path: Path) -> Any:
        """A run from disk: a qkv run (qkv.tasks.load), or a SAELens directory with the model and data given."""
        from qkv.tasks import load
        from qkv.tasks.sae_open import is_saelens, saelens_run

        if self.lm is not None and is_saelens(path):
            return saelens_run(path, self.lm, self.data)
        return load(path, self.checkpoint)


def _run_dirs(root: Path, depth: int) -> list[Path]:
    """Directories with a config.json at most `depth` levels under root, without following links out of it."""
    found: list[Path] = []
    if not root.is_dir():
        return found
    for directory, subdirs, files in os.walk(root):
        here = Path(directory)
        if ("config.json" in files or "cfg.json" in files) and here != root:  # a qkv run, or a SAELens SAE
            found.append(here)
        if len(here.relative_to(root).parts) >= depth:
            subdirs.clear()
        subdirs.sort()
    return found
