"""Run logs: one JSON line per update in ``metrics.jsonl`` and the same scalars in TensorBoard;
progress bars for the stages of an update."""

from __future__ import annotations

import io
import json
import logging
import math
import os
import pathlib
import socket
import struct
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
    checkpoint (written before the crash) are dropped so the log matches the resumed state, and so
    is a last line cut short (a crash or a refused write mid-line). A write the file system refuses
    raises ``StorageError``."""

    def __init__(self, out: str | os.PathLike, truncate_after: int | None = None):
        self.path = pathlib.Path(out) / "metrics.jsonl"
        self._tb_dir = pathlib.Path(out) / "tb"
        if truncate_after is not None and self.path.exists():
            kept = [r for r in read_records(self.path) if r["update"] <= truncate_after and not r.get("final")]
            partial = self.path.with_suffix(".jsonl.tmp")  # a refused rewrite leaves the log as it was
            with open(partial, "wb", buffering=0) as file:
                _write_all(file, "".join(json.dumps(r) + "\n" for r in kept).encode(), "the metrics log", self.path)
            os.replace(partial, self.path)
        # Both files unbuffered: the bytes of a refused write stay in no buffer for close() to fail
        # on again. TensorBoard's events are written here rather than by tensorboardX's
        # SummaryWriter: its writer thread dies on a refused write, and its queue then blocks the
        # process for ever. Its file name has the process id: a resume in the same second gets a
        # file of its own, not the end of one a refused write tore.
        self._file = open(self.path, "ab", buffering=0)
        self._tb_dir.mkdir(exist_ok=True)
        name = f"events.out.tfevents.{int(time.time())}.{socket.gethostname()}.{os.getpid()}"
        self._tb = open(self._tb_dir / name, "ab", buffering=0)
        _write_all(self._tb, _event(file_version="brain.Event:2"), "the TensorBoard log", self._tb_dir)

    def write(self, update: int, metrics: dict[str, float], final: bool = False) -> None:
        record = {"update": update, **({"final": True} if final else {}), **metrics}
        line = json.dumps({k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in record.items()})
        what = f"the {'final ' if final else ''}metrics of update {update}"
        _write_all(self._file, (line + "\n").encode(), what, self.path)
        prefix = "final/" if final else ""
        events = [
            _event(step=update, summary=_scalar(prefix + key, value))
            for key, value in metrics.items()
            if isinstance(value, (int, float)) and not math.isnan(value)
        ]
        _write_all(self._tb, b"".join(events), what, self._tb_dir)

    def close(self) -> None:
        self._file.close()
        self._tb.close()


# TensorBoard's records are written by hand: tensorboardX's package imports torch (2 s at every
# start of a run) for the four protobuf fields below. Read back with tensorboardX's own Event and
# crc, and against its SummaryWriter, in tests/faults/test_storage_faults.py.
def _varint(n: int) -> bytes:
    n &= (1 << 64) - 1  # an int64 below 0 as its two's complement, as protobuf writes it
    out = bytearray()
    while True:
        n, low = n >> 7, n & 0x7F
        out.append(low | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _field(number: int, wire_type: int, payload: bytes) -> bytes:
    """A protobuf field: wire type 0 varint, 1 eight bytes, 2 length-delimited, 5 four bytes."""
    return _varint(number << 3 | wire_type) + (_varint(len(payload)) + payload if wire_type == 2 else payload)


def _scalar(tag: str, value: float) -> bytes:
    """A ``Summary`` of one ``Value``: tag (1), simple_value (2, a float)."""
    return _field(1, 2, _field(1, 2, tag.encode()) + _field(2, 5, struct.pack("<f", value)))


def _event(step: int = 0, summary: bytes = b"", file_version: str = "") -> bytes:
    """An ``Event`` (wall_time 1, step 2, file_version 3, summary 5), framed as a record of the
    event files (TFRecord: length, its masked crc32c, data, the data's masked crc32c)."""
    data = _field(1, 1, struct.pack("<d", time.time())) + (_field(2, 0, _varint(step)) if step else b"")
    data += (_field(3, 2, file_version.encode()) if file_version else b"") + (_field(5, 2, summary) if summary else b"")
    header = struct.pack("<Q", len(data))
    return header + struct.pack("<I", _masked_crc32c(header)) + data + struct.pack("<I", _masked_crc32c(data))


def _crc32c_table() -> tuple[int, ...]:
    table = []
    for byte in range(256):
        crc = byte
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 if crc & 1 else 0)  # Castagnoli's polynomial, reflected
        table.append(crc)
    return tuple(table)


_CRC32C = _crc32c_table()


def _masked_crc32c(data: bytes) -> int:
    crc = 0xFFFFFFFF
    for byte in data:
        crc = _CRC32C[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    crc ^= 0xFFFFFFFF
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def _write_all(file: io.FileIO, data: bytes, what: str, where: pathlib.Path) -> None:
    """Writes ``data`` to an unbuffered file; a refused write raises ``StorageError`` naming ``what``
    and ``where``. A call may write part of the data (what fits before the file system refuses);
    the call after that raises why."""
    # Not imported with this module: Orbax, which checkpoints imports, sets up a root log handler,
    # and console_logging() would then set up none.
    from orsd_jax.checkpoints import refused_writes

    with refused_writes(what, where):
        view = memoryview(data)
        while view:
            view = view[file.write(view) :]


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
