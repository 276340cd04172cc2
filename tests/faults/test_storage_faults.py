"""The run's storage failing for real: a process SIGKILLed in the middle of an Orbax save, and
writes the file system refuses. A refusal comes from a file-size limit (RLIMIT_FSIZE) the child
process sets itself; Python ignores SIGXFSZ, so a write past the limit fails with EFBIG ("File too
large") as a full disk fails with ENOSPC. Each fault happens in a child process; the test process
then opens what it left, as ``--resume`` would, and asserts what the user sees and what is kept.
"""

from __future__ import annotations

import os
import pathlib
import signal
import struct
import subprocess
import sys
import time
from collections.abc import Callable

import jax
import numpy as np
from flax import nnx

from orsd_jax.checkpoints import Checkpoints
from orsd_jax.metrics_log import MetricsLog, read_records
from orsd_jax.models import CausalLM, ModelConfig, load_hf_params
from orsd_jax.trainer import export_policy

REPO = pathlib.Path(__file__).resolve().parents[2]
SMALL = np.arange(12, dtype=np.float32)
RESUME = (
    "the run's checkpoints are intact: free space there, then run again with --resume to continue from the last one"
)


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO)}


def _python(code: str, *args: object, stderr) -> subprocess.Popen:
    command = [sys.executable, "-c", code, *map(str, args)]
    return subprocess.Popen(command, cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=stderr, text=True)


def _run(code: str, *args: object) -> subprocess.CompletedProcess:
    """``code`` run to its end in a child process (killed after 60 s), which must fail."""
    command = [sys.executable, "-c", code, *map(str, args)]
    child = subprocess.run(command, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=60)
    assert child.returncode == 1, child.stderr[-3000:]
    return child


def _last_line(text: str) -> str:
    return text.rstrip().splitlines()[-1]


# Checkpoint 2 is 200 MB of noise (it does not compress), so its save takes seconds: time to kill it.
SAVES = """
import sys
import numpy as np
from orsd_jax.checkpoints import Checkpoints

checkpoints = Checkpoints(sys.argv[1])
checkpoints.save(1, {"w": np.arange(12, dtype=np.float32)}, {"update": 1})
print("saved 1", flush=True)
checkpoints.save(2, {"w": np.random.default_rng(0).standard_normal(50_000_000, dtype=np.float32)}, {"update": 2})
"""


def _unfinished(directory: pathlib.Path) -> list[str]:
    """The entries of a checkpoint directory that are not a finished checkpoint (Orbax's temporary ones)."""
    return sorted(p.name for p in directory.iterdir() if not p.name.isdigit())


def _wait(condition: Callable[[], object], seconds: float, failure: str) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, failure
        time.sleep(0.005)


def _restore(checkpoints: Checkpoints) -> tuple[int, np.ndarray, dict]:
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    restored = checkpoints.restore_latest({"w": jax.ShapeDtypeStruct(SMALL.shape, SMALL.dtype, sharding=sharding)})
    assert restored is not None
    update, state, meta = restored
    return update, np.asarray(state["w"]), meta


def test_a_save_killed_midway_leaves_the_checkpoint_before_it_and_no_temporary_directory(tmp_path):
    directory = tmp_path / "checkpoints"
    with open(tmp_path / "stderr", "w") as err:  # a file: Orbax's log lines could fill a pipe
        child = _python(SAVES, directory, stderr=err)
        assert child.stdout is not None and child.stdout.readline() == "saved 1\n", (tmp_path / "stderr").read_text()
        _wait(lambda: _unfinished(directory) or child.poll() is not None, 60, "checkpoint 2's save did not start")
        assert child.poll() is None, "checkpoint 2 was saved before it could be killed"
        child.send_signal(signal.SIGKILL)
        child.wait()
    left = _unfinished(directory)
    assert left and all(name.startswith("2.") for name in left), left  # the killed save's temporary directory

    checkpoints = Checkpoints(directory)
    _wait(lambda: not _unfinished(directory), 10, "the killed save's temporary directory is still there")
    assert checkpoints.steps() == [1]
    update, w, meta = _restore(checkpoints)
    assert (update, meta) == (1, {"update": 1})
    np.testing.assert_array_equal(w, SMALL)
    checkpoints.save(2, {"w": 2 * SMALL}, {"update": 2})
    assert not _unfinished(directory)
    assert checkpoints.steps() == [1, 2]
    update, w, meta = _restore(checkpoints)
    assert (update, meta) == (2, {"update": 2})
    np.testing.assert_array_equal(w, 2 * SMALL)
    checkpoints.close()


# The second record (about 20 kB) crosses a limit 100 bytes past the log's size.
METRICS = """
import resource, sys
from orsd_jax.metrics_log import MetricsLog

log = MetricsLog(sys.argv[1])
log.write(1, {"loss": 0.5})
limit = log.path.stat().st_size + 100
resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
log.write(2, {f"metric/{i}": float(i) for i in range(1000)})
"""


def test_a_refused_metrics_write_stops_with_one_line_and_the_log_resumes(tmp_path):
    path = tmp_path / "metrics.jsonl"
    assert _last_line(_run(METRICS, tmp_path).stderr) == (
        f"orsd_jax.checkpoints.StorageError: the metrics of update 2 could not be written to {path} "
        f"(File too large); {RESUME}"
    )
    _, torn = path.read_text().split("\n")
    assert len(torn) == 100  # the file system took the part of the record below the limit

    log = MetricsLog(tmp_path, truncate_after=1)  # as a resume from checkpoint 1: the torn line goes
    log.write(2, {"loss": 0.25})
    log.close()
    assert read_records(path) == [{"update": 1, "loss": 0.5}, {"update": 2, "loss": 0.25}]


# TensorBoard's events file grows faster per metric than metrics.jsonl: at twice the log's size,
# the log takes the second record and the events file does not.
TENSORBOARD = """
import resource, sys
from orsd_jax.metrics_log import MetricsLog

log = MetricsLog(sys.argv[1])
log.write(1, {f"a_metric_with_a_long_name_{i}": float(i) for i in range(400)})
limit = 2 * log.path.stat().st_size
resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
log.write(2, {f"m{i}": float(i) for i in range(1000)})
"""


def test_a_refused_tensorboard_write_stops_with_one_line_rather_than_hang(tmp_path):
    assert _last_line(_run(TENSORBOARD, tmp_path).stderr) == (
        f"orsd_jax.checkpoints.StorageError: the metrics of update 2 could not be written to {tmp_path / 'tb'} "
        f"(File too large); {RESUME}"
    )
    log = MetricsLog(tmp_path, truncate_after=1)  # the second record, whole in metrics.jsonl, goes
    log.write(2, {"loss": 0.25})
    log.close()
    assert [r["update"] for r in read_records(tmp_path / "metrics.jsonl")] == [1, 2]


def _scalars(directory: pathlib.Path) -> list[tuple[int, str, float]]:
    """(step, tag, value) of every scalar in the event files of ``directory``, read record by record
    (TFRecord framing: length, its CRC, the event, its CRC; both CRCs checked)."""
    from tensorboardX.proto.event_pb2 import Event
    from tensorboardX.record_writer import masked_crc32c

    out = []
    for path in sorted(directory.glob("events.out.tfevents.*")):
        data, i = path.read_bytes(), 0
        while i < len(data):
            (n,) = struct.unpack("Q", data[i : i + 8])
            assert struct.unpack("I", data[i + 8 : i + 12])[0] == masked_crc32c(data[i : i + 8])
            body = data[i + 12 : i + 12 + n]
            assert struct.unpack("I", data[i + 12 + n : i + 16 + n])[0] == masked_crc32c(body)
            event, i = Event.FromString(body), i + 16 + n
            out += [(event.step, v.tag, v.simple_value) for v in event.summary.value]
    return out


def test_tensorboard_events_are_those_tensorboardx_writes(tmp_path):
    """MetricsLog writes TensorBoard's event files itself (tensorboardX's SummaryWriter hangs on a
    refused write): they hold what SummaryWriter writes for the same scalars, NaN left out."""
    from tensorboardX import SummaryWriter

    (tmp_path / "ours").mkdir()
    log = MetricsLog(tmp_path / "ours")
    log.write(1, {"loss": 0.5, "env/success": 0.25, "rubric/correlation": float("nan"), "note": "not a scalar"})
    log.write(300, {"loss": -1.5e-3, "budget/env_steps": 123457}, final=True)  # steps and ints of several bytes
    log.close()
    writer = SummaryWriter(str(tmp_path / "theirs"))
    expected = [
        (1, "loss", 0.5),
        (1, "env/success", 0.25),
        (300, "final/loss", -1.5e-3),
        (300, "final/budget/env_steps", 123457),
    ]
    for step, tag, value in expected:
        writer.add_scalar(tag, value, step)
    writer.close()
    expected = [(step, tag, float(np.float32(value))) for step, tag, value in expected]
    assert _scalars(tmp_path / "ours" / "tb") == _scalars(tmp_path / "theirs") == expected


CONFIG = ModelConfig(
    "qwen3", vocab_size=96, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8
)

# The trainer's export of the final policy, under a 4 kB limit (the weights are about 100 kB).
EXPORT = f"""
import pathlib, resource, sys
from flax import nnx
from transformers import AutoTokenizer
from orsd_jax.models import EMBEDDED, CausalLM, ModelConfig, resolve
from orsd_jax.trainer import export_policy

model = CausalLM({CONFIG!r}, nnx.Rngs(0))
tokenizer = AutoTokenizer.from_pretrained(resolve(EMBEDDED))
resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))
export_policy(model, tokenizer, pathlib.Path(sys.argv[1]))
"""


def test_a_refused_policy_export_stops_with_one_line_and_a_rerun_exports(tmp_path):
    out = tmp_path / "policy"
    assert _last_line(_run(EXPORT, out).stderr) == (
        f"orsd_jax.checkpoints.StorageError: the final policy could not be written to {out} (File too large); {RESUME}"
    )
    model = CausalLM(CONFIG, nnx.Rngs(0))
    export_policy(model, None, out)  # over the partial files the refused export left
    exported = load_hf_params(out)
    for (path, a), (_, b) in zip(nnx.to_flat_state(nnx.state(model)), nnx.to_flat_state(nnx.state(exported))):
        np.testing.assert_array_equal(np.asarray(a[...]), np.asarray(b[...]), err_msg=str(path))
