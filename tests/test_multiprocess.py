"""Several JAX processes (``orsd_jax.distributed``): a ``tiny`` run on 2 processes of 2 CPU devices
each, its coordinator on 127.0.0.1, its parameters FSDP-sharded over both, killed after update 1
and resumed, ends where the same run on 1 process of 4 devices with replicated parameters does
(the parameters within 1e-5, the same metrics)."""

import os
import pathlib
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest
from helpers import UNOPTIMISED, run_metrics, without_timing
from safetensors.numpy import load_file

REPO = pathlib.Path(__file__).resolve().parents[1]


def _launch(out: pathlib.Path, devices: int, *extra: str) -> subprocess.Popen:
    command = [sys.executable, "-m", "experiments.train_alfworld", "--preset", "tiny", "--updates", "2"]
    # Unoptimised: these runs' sharded programs are compiled by no other test (74 s against 93).
    env = {**os.environ, **UNOPTIMISED, "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}"}
    return subprocess.Popen(
        [*command, "--out", str(out), *extra], cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )


def _processes(out: pathlib.Path, *extra: str) -> list[subprocess.Popen]:
    with socket.socket() as s:  # a free port for the coordinator
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    flags = ["--coordinator", f"127.0.0.1:{port}", "--processes", "2"]
    return [_launch(out, 2, *flags, "--process-id", str(i), *extra) for i in range(2)]


def _finish(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        _, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, err.decode()[-3000:]


@pytest.mark.slow
def test_two_processes_killed_and_resumed_end_where_one_process_does(tmp_path):
    one = tmp_path / "one"
    reference = _launch(one, 4)
    two = tmp_path / "two"
    procs = _processes(two, "--fsdp")  # parameters sharded over the processes, gathered for the sampler
    deadline = time.time() + 600
    while not (two / "checkpoints" / "1").is_dir():  # Orbax renames a checkpoint into place when complete
        for proc in procs:
            assert proc.poll() is None, proc.stderr.read().decode()[-3000:]
        assert time.time() < deadline, "no checkpoint within 10 minutes"
        time.sleep(0.2)
    for proc in procs:  # as a scheduler preempts a job: every process at once
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert not (two / "policy").exists()
    _finish(_processes(two, "--resume"))
    _finish([reference])

    got, want = run_metrics(two), run_metrics(one)
    assert [r["update"] for r in got] == [1, 2, 2]  # update 2 and the final evaluation, once each
    for a, b in zip(got, want):
        assert without_timing(a) == pytest.approx(without_timing(b), rel=1e-4, abs=1e-5, nan_ok=True), a["update"]
    trained, initial = (
        load_file(two / "policy" / "model.safetensors"),
        load_file(one / "initial_policy" / "model.safetensors"),
    )
    for name, tensor in load_file(one / "policy" / "model.safetensors").items():
        np.testing.assert_allclose(trained[name], tensor, rtol=0, atol=1e-5, err_msg=name)
    moved = max(float(np.max(np.abs(tensor - initial[name]))) for name, tensor in trained.items())
    assert moved > 1e-3  # the runs trained: agreeing within 1e-5 says something
