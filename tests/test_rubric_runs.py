"""Tiny runs in which groups do get rubrics: the with-rubric replay, the rubric memory, and an exact
resume of a run with a non-empty memory after SIGKILL (the trainer's SIGKILL test: a metrics line
cut short by the kill is dropped, config.json is not rewritten).

The tiny preset's random policy never writes an answer in the format, so its groups' returns are
equal and selection keeps no rubric. A tiny model fine-tuned for a few steps on the tiny games'
planner walkthroughs answers in the format some of the time: returns (outcome less invalid-answer
penalties) then differ within groups, oracle bundles are selected by their correlation with them,
and the memory fills.
"""

import json
import pathlib
import signal
import subprocess
import sys
import time

import pytest
from flax import nnx
from helpers import optimized, run_metrics, without_timing
from safetensors.numpy import load_file
from transformers import AutoTokenizer

from orsd_jax import chat
from orsd_jax.config import preset
from orsd_jax.demos import alfworld_walkthrough, walkthrough_demos
from orsd_jax.envs.alfworld import AlfworldEnv, build_prompt, default_games, load_split
from orsd_jax.models import EMBEDDED, CausalLM, ModelConfig, resolve, save_hf
from orsd_jax.train_step import OptimizerConfig
from orsd_jax.warmstart import FinetuneConfig, finetune

REPO = pathlib.Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.slow  # the fixtures: a fine-tune and a 4-update run
UPDATES = 4


@pytest.fixture(scope="module")
def readable_policy(tmp_path_factory) -> pathlib.Path:
    """The tiny preset's model after 60 steps on the walkthroughs of its 8 train games (answers in the
    format about half the time at temperature 1, measured when this test was written)."""
    tiny = preset("tiny")
    tokenizer = AutoTokenizer.from_pretrained(resolve(EMBEDDED))
    fmt = chat.chat_format(tokenizer)
    shape = {"vocab_size": len(tokenizer), "eos_token_id": tokenizer.eos_token_id, **tiny.model.random_shape}
    model = CausalLM(ModelConfig(**shape), nnx.Rngs(0))
    e = tiny.env
    tasks = load_split(default_games(e.difficulty, e.games_seed, e.train_games, e.eval_games), "train")
    env = AlfworldEnv(max_steps=tiny.rollout.max_steps)
    try:
        demos = walkthrough_demos(
            env, tasks, alfworld_walkthrough, tiny.rollout, build_prompt, tokenizer=tokenizer, fmt=fmt, reasoning=False
        )
    finally:
        env.close()
    config = FinetuneConfig(epochs=60, batch_size=len(demos), optimizer=OptimizerConfig(learning_rate=1e-2))
    out = tmp_path_factory.mktemp("readable") / "policy"
    with optimized():  # 60 steps over prompts of about 1,000 tokens: 35 s, unoptimised 66 s
        save_hf(finetune(model, demos, config, fmt=fmt), tokenizer, out)
    return out


def _start(policy: pathlib.Path, out: pathlib.Path, *extra: str) -> subprocess.Popen:
    """A tiny ORSD run of oracle rubrics ranked by returns, the remembered bundle offered as a candidate
    (the memory's other use, examples in the writer's prompt, needs the policy as the writer)."""
    command = [
        *(sys.executable, "-m", "experiments.train_alfworld", "--preset", "tiny", "--model", str(policy)),
        *("--updates", str(UPDATES), "--rubric-source", "oracle", "--rank-by", "return"),
        *("--memory-candidate", "--max-response-tokens", "32", "--out", str(out)),
        *extra,
    ]
    return subprocess.Popen(command, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


@pytest.fixture(scope="module")
def reference(readable_policy, tmp_path_factory) -> pathlib.Path:
    out = tmp_path_factory.mktemp("reference") / "run"
    _, err = (proc := _start(readable_policy, out)).communicate(timeout=900)
    assert proc.returncode == 0, err[-3000:]
    return out


def test_groups_get_rubrics_and_the_memory_fills(readable_policy, reference):
    config = json.loads((reference / "config.json").read_text())
    assert config["model"]["name"] == str(readable_policy) and config["rubric"]["rank_by"] == "return"
    records = run_metrics(reference)[:UPDATES]
    assert sum(r["rubric/groups_with_rubric"] for r in records) >= 2
    with_rubric = [r for r in records if r["rubric/groups_with_rubric"]]
    assert all(r["loss/gap_std"] > 0 for r in with_rubric)  # the with-rubric replay ran and moved log-probs
    memory = json.loads((reference / "rubric_memory.json").read_text())
    assert memory["entries"] and all(c["selected"] >= 1 for v in memory["entries"].values() for c in v)
    sizes = {
        k.removeprefix("rubric/memory/size/"): v for k, v in records[-1].items() if k.startswith("rubric/memory/size/")
    }
    assert sizes == {key: len(v) for key, v in memory["entries"].items()}
    assert sum(r["rubric/memory/offered"] for r in records) >= 1  # a remembered bundle joined the candidates


def test_exact_resume_of_a_run_with_memory_after_sigkill(readable_policy, reference, tmp_path):
    out = tmp_path / "killed"
    proc = _start(readable_policy, out)
    deadline = time.time() + 600
    while not (out / "checkpoints" / "2").is_dir():  # Orbax renames a checkpoint into place when complete
        assert proc.poll() is None, proc.stderr.read()[-3000:] if proc.stderr else ""
        assert time.time() < deadline, "no second checkpoint within 10 minutes"
        time.sleep(0.2)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    killed_memory = json.loads((out / "rubric_memory.json").read_text())
    assert killed_memory["entries"], "the memory was empty when the run was killed: nothing to restore"
    config_record = (out / "config.json").stat().st_mtime_ns
    with open(out / "metrics.jsonl", "a") as f:  # as a kill in the middle of a write leaves it
        f.write('{"update": 3, "env/succ')
    _, err = (resumed := _start(readable_policy, out, "--resume")).communicate(timeout=900)
    assert resumed.returncode == 0, err[-3000:]
    assert "dropping its last line, cut short" in err
    assert (out / "config.json").stat().st_mtime_ns == config_record  # not rewritten on resume
    got, want = run_metrics(out), run_metrics(reference)
    assert [r["update"] for r in got] == [*range(1, UPDATES + 1), UPDATES]
    for a, b in zip(got, want):
        assert without_timing(a) == pytest.approx(without_timing(b), rel=1e-6, abs=1e-7, nan_ok=True), a["update"]
    assert (out / "rubric_memory.json").read_text() == (reference / "rubric_memory.json").read_text()
    for name, tensor in load_file(reference / "policy" / "model.safetensors").items():
        assert (load_file(out / "policy" / "model.safetensors")[name] == tensor).all(), name
