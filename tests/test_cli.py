"""The training command line: dry-run plans of the paper presets, flags mapped onto the config, and
how a signal stops a run."""

import os
import pathlib
import signal
import subprocess
import sys
import textwrap

import pytest

from experiments.common import config_from_args, main, parser
from orsd_jax.config import preset


@pytest.mark.parametrize("env", ["alfworld", "webshop"])
@pytest.mark.parametrize("name", ["paper-qwen3-1.7b", "paper-qwen3-4b"])
def test_dry_run_prints_the_plan(env, name, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(env, "", ["--preset", name, "--dry-run"])
    out = capsys.readouterr().out
    assert exit_.value.code == 0, out
    model = "Qwen/Qwen3-4B" if name.endswith("4b") else "Qwen/Qwen3-1.7B"
    assert f"preset {name}, method orsd, environment {env}, model {model}" in out
    assert "devices: 4 (" in out and "mesh ('data',) = (4,)" in out
    assert "memory per device (GB):" in out and " of 80 (an A100 80GB; fits, 90% usable)" in out
    assert "interaction budget: 300 updates x 8 tasks x 8 rollouts = 19200 episodes" in out


def test_a_cpu_plan_is_held_against_this_hosts_memory(capsys):
    with pytest.raises(SystemExit) as exit_:
        main("alfworld", "", ["--preset", "cpu-demo", "--dry-run"])
    out = capsys.readouterr().out
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9
    assert f" of {host:.0f} (this host's memory; " in out, out
    assert exit_.value.code == (0 if "; fits, 90% usable)" in out else 2)


def test_dry_run_plans_two_hosts_and_attached_samplers(capsys):
    urls = "http://10.0.0.1:8100,http://10.0.0.2:8100"
    argv = ["--preset", "paper-qwen3-4b", "--processes", "2", "--sampler-urls", urls, "--dry-run"]
    with pytest.raises(SystemExit) as exit_:
        main("alfworld", "", argv)
    out = capsys.readouterr().out
    assert exit_.value.code == 0, out
    assert "processes: 2, 2 devices each; process 0 runs the sampler" in out
    assert f"sampler: 2 attached vLLM server(s) ({urls.replace(',', ', ')})" in out
    with pytest.raises(SystemExit, match="--devices 4 do not split over 3 processes"):
        main("alfworld", "", ["--preset", "paper-qwen3-4b", "--processes", "3", "--dry-run"])


def test_dry_run_fails_clearly_when_the_plan_does_not_fit(capsys):
    # Qwen3-4B with replicated f32 parameters and AdamW on one 80 GB device.
    with pytest.raises(SystemExit) as exit_:
        main("alfworld", "", ["--preset", "paper-qwen3-4b", "--no-fsdp", "--devices", "1", "--dry-run"])
    out = capsys.readouterr().out
    assert exit_.value.code == 2
    assert "DOES NOT FIT" in out and "the plan does not fit: use --fsdp, more --devices or more micro-batches" in out


def test_flags_override_the_preset():
    args = parser("alfworld", "").parse_args(
        [
            "--preset",
            "cpu-demo",
            "--method",
            "grpo",
            "--updates",
            "5",
            "--coef",
            "0.3",
            "--candidates",
            "2",
            "--min-correlation",
            "0",
            "--model",
            "some/dir",
            "--verifier",
            "openai",
            "--verifier-url",
            "http://127.0.0.1:9/v1",
            "--verifier-model",
            "m",
            "--task-types",
            "pick,clean",
        ]
    )
    c = config_from_args("alfworld", args)
    assert (c.method, c.updates, c.loss.coef, c.rubric.candidates) == ("grpo", 5, 0.3, 2)
    assert c.rubric.min_correlation == 0.0 and preset("cpu-demo").rubric.min_correlation is None
    assert c.env.task_types == ("pick", "clean") and preset("cpu-demo").env.task_types == ("look",)
    assert c.model.name == "some/dir" and c.model.warmstart is None  # an explicit model replaces the warm start
    assert c.verifier.kind == "openai" and c.verifier.endpoint.base_url == "http://127.0.0.1:9/v1"
    assert c.resolved().loss.coef == 0.0  # GRPO: no correction whatever --coef says
    with pytest.raises(SystemExit):
        config_from_args("alfworld", parser("alfworld", "").parse_args(["--verifier", "openai"]))


def test_calibration_flags_reach_the_config():
    flags = ["--train-pool", "8", "--warmup-steps", "16", "--no-normalize-std", "--kl-coef", "0.01", "--lr", "2e-4"]
    c = config_from_args("alfworld", parser("alfworld", "").parse_args(flags))
    assert (c.env.train_pool, c.optimizer.warmup_steps, c.loss.kl_coef, c.optimizer.learning_rate) == (
        8,
        16,
        0.01,
        2e-4,
    )
    assert c.resolved().advantage.normalize_std is False  # not verl-agent's (True for GRPO on ALFWorld)
    default = config_from_args("alfworld", parser("alfworld", "").parse_args([]))
    assert default.env.train_pool is None and default.optimizer.warmup_steps == 0 and default.loss.kl_coef == 0.0
    assert default.resolved().advantage.normalize_std is True


# A process that gets SIGTERM while a garbage-collection callback runs, as a run does when JAX's
# callback is running: the handler's Stopped is raised inside the callback, where Python only prints
# it. With ``stop_on_signals`` the process stops anyway; with the signal handlers alone it goes on.
_SIGNAL_IN_GC_CALLBACK = textwrap.dedent(
    """
    import gc, os, signal, sys, time
    from experiments import common
    if sys.argv[1] == "hook":
        common.stop_on_signals()
    else:
        signal.signal(signal.SIGTERM, common._stop_on)
    sent = []
    def callback(phase, info):
        if phase == "start" and not sent:
            sent.append(True)
            os.kill(os.getpid(), signal.SIGTERM)
            sum(range(1000))  # a call: the pending handler runs here, inside the callback
    gc.callbacks.append(callback)
    try:
        gc.collect()
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            time.sleep(0.01)
        print("went on")
    except common.Stopped as stop:
        print("stopped by", stop)
        sys.exit(128 + stop.signum)
    """
)


@pytest.mark.parametrize("hook", [True, False])
def test_a_signal_raised_inside_a_gc_callback_still_stops_the_run(hook):
    result = subprocess.run(
        [sys.executable, "-c", _SIGNAL_IN_GC_CALLBACK, "hook" if hook else "handlers"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=pathlib.Path(__file__).parents[1],
    )
    if hook:
        assert result.returncode == 128 + signal.SIGTERM, result.stderr
        assert result.stdout == "stopped by SIGTERM\n" and "Exception ignored" not in result.stderr
    else:  # the failure the hook fixes: the stop is printed as ignored and the process goes on
        assert result.returncode == 0 and result.stdout == "went on\n", result.stderr
        assert "Exception ignored" in result.stderr and "Stopped: SIGTERM" in result.stderr
