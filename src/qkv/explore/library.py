"""The runs the explorer may open: RUN_DIR and the run directories under runs/, nothing outside them.

Importing this module loads no torch: the server answers its first request before the models are read.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qkv.errors import QkvError

TASKS = ("lm", "translate", "mlm")  # the tasks whose runs read text (copy and reverse use digit vocabularies)
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

    def __init__(self, run_dir: Path | None, search: Path, checkpoint: str = "best") -> None:
        self.base = Path.cwd().resolve()
        self.search = search.resolve()
        self.roots = [self.search] + ([run_dir.resolve()] if run_dir is not None else [])
        self.checkpoint = checkpoint
        self.default = self._info(run_dir.resolve()) if run_dir is not None else None
        if run_dir is not None and self.default is None:
            raise QkvError(f"{run_dir} is not a run directory of a task with text ({', '.join(TASKS)})")
        self._loaded: dict[Path, Any] = {}
        self._lock = threading.Lock()

    def _name(self, path: Path) -> str:
        """How a run is named on the page and in requests: relative to the working directory when inside it."""
        return str(path.relative_to(self.base)) if path.is_relative_to(self.base) else str(path)

    def _info(self, path: Path) -> RunInfo | None:
        """The run at `path`, or None when it is no run directory of a task with text."""
        try:
            config = json.loads((path / "config.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None
        task = config.get("task") if isinstance(config, dict) else None
        return RunInfo(self._name(path), task, path) if task in TASKS else None

    def available(self) -> list[RunInfo]:
        """Every run the page may open: RUN_DIR first, then the runs found under the search directory."""
        found = [self.default] if self.default is not None else []
        configs = sorted(self.search.rglob("config.json")) if self.search.is_dir() else []
        for config in configs:
            if len(config.relative_to(self.search).parts) <= SEARCH_DEPTH + 1:
                info = self._info(config.parent.resolve())
                if info is not None and info not in found:
                    found.append(info)
        return found

    def resolve(self, name: str) -> RunInfo:
        """The run a request names, refused when outside the served directories (403) or not a run (404)."""
        path = Path(name) if Path(name).is_absolute() else self.base / name
        path = path.resolve()
        if not any(path.is_relative_to(root) for root in self.roots):
            raise RequestError(403, f"{name!r} is outside the directories the explorer serves "
                                    f"({', '.join(self._name(r) for r in self.roots)})")  # fmt: skip
        info = self._info(path)
        if info is None:
            raise RequestError(404, f"no run named {name!r}: it is not a run directory of a task with text")
        return info

    def load(self, name: str) -> Any:
        """The loaded run (qkv.tasks.load) a request names; each run is read from disk once."""
        from qkv.tasks import load

        info = self.resolve(name)
        with self._lock:
            if info.path not in self._loaded:
                self._loaded[info.path] = load(info.path, self.checkpoint)
            return self._loaded[info.path]
