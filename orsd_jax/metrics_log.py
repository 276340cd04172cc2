"""Run logs: one JSON line per update in ``metrics.jsonl`` and the same scalars in TensorBoard;
progress bars for the stages of an update."""

from __future__ import annotations

import json
import logging
import math
import os
import pathlib
import sys
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import TypeVar

from tqdm import tqdm

T = TypeVar("T")


def console_logging() -> None:
    """INFO lines with the clock time; the chatty libraries (Orbax per file, HTTP per request) quieted."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    for chatty in ("absl", "httpx", "httpx2"):  # httpx2: the openai client's
        logging.getLogger(chatty).setLevel(logging.WARNING)
    # JAX logs its backend probe at INFO ("Unable to initialize backend 'tpu'" without libtpu);
    # its warnings still show, and a level the user chose with JAX_LOGGING_LEVEL is kept.
    if logging.getLogger("jax").level == logging.NOTSET:
        logging.getLogger("jax").setLevel(logging.WARNING)


class MetricsLog:
    """Appends to ``metrics.jsonl`` and ``tb/``. On resume, lines of updates after the restored
    checkpoint (written before the crash) are dropped so the log matches the resumed state."""

    def __init__(self, out: str | os.PathLike, truncate_after: int | None = None):
        from tensorboardX import SummaryWriter

        self.path = pathlib.Path(out) / "metrics.jsonl"
        if truncate_after is not None and self.path.exists():
            kept = [r for r in read_records(self.path) if r["update"] <= truncate_after and not r.get("final")]
            self.path.write_text("".join(json.dumps(r) + "\n" for r in kept))
        self._file = open(self.path, "a")
        self._tb = SummaryWriter(str(pathlib.Path(out) / "tb"))

    def write(self, update: int, metrics: dict[str, float], final: bool = False) -> None:
        record = {"update": update, **({"final": True} if final else {}), **metrics}
        self._file.write(
            json.dumps({k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in record.items()}) + "\n"
        )
        self._file.flush()
        for key, value in metrics.items():
            if isinstance(value, (int, float)) and not math.isnan(value):
                self._tb.add_scalar(("final/" if final else "") + key, value, update)
        self._tb.flush()

    def close(self) -> None:
        self._file.close()
        self._tb.close()


def read_records(path: pathlib.Path) -> list[dict]:
    """The records of a ``metrics.jsonl``. A last line cut short (a process killed mid-write) is
    dropped with a warning; a damaged line before it is an error (the log is not this run's)."""
    lines = path.read_text().splitlines() if path.is_file() else []
    records = []
    for i, line in enumerate(lines):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            if i + 1 < len(lines):
                raise ValueError(f"{path}: line {i + 1} is not JSON: {line[:80]!r}") from None
            logging.getLogger(__name__).warning("%s: dropping its last line, cut short: %r", path, line[:80])
    return records


def progress(items: Iterable[T], stage: str, **kwargs) -> Iterable[T]:
    """A progress bar on stderr for one stage (silent when stderr is not a terminal and
    ``ORSD_PROGRESS`` is unset, e.g. in tests)."""
    disable = not (sys.stderr.isatty() or os.environ.get("ORSD_PROGRESS"))
    return tqdm(items, desc=stage, leave=False, dynamic_ncols=True, disable=disable, **kwargs)


@contextmanager
def timed(metrics: dict[str, float], name: str) -> Iterator[None]:
    """Adds the wall time of the ``with`` block to ``metrics`` as ``time/<name>``."""
    started = time.perf_counter()
    yield
    metrics[f"time/{name}"] = time.perf_counter() - started
