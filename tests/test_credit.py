"""Per-token credit: the recorded values are the loss's own, the notebook runs top to bottom on a
``tiny`` run, and the HTML report renders in headless Chromium."""

import dataclasses
import html.parser
import json
import os
import pathlib

import jax.numpy as jnp
import nbformat
import numpy as np
import pytest
from flax import nnx
from helpers import make_samples, tiny_model
from nbclient import NotebookClient
from PIL import Image
from transformers import AutoTokenizer

from experiments.credit_report import rendered_dom, screenshot, write_report
from orsd_jax.batch import build_batch
from orsd_jax.config import preset
from orsd_jax.credit import load_credit, load_samples, recorded_updates, run_tokenizer, token_pieces
from orsd_jax.credit_html import gap_colour
from orsd_jax.loss import LossConfig, OrsdLoss
from orsd_jax.minibatches import Step, train_minibatches
from orsd_jax.models import EMBEDDED, resolve
from orsd_jax.train_step import init_train_state, make_mesh, make_optimizer, make_train_step
from orsd_jax.trainer import train

REPO = pathlib.Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> pathlib.Path:
    out = tmp_path_factory.mktemp("tiny-orsd")
    train(preset("tiny"), out)
    return out


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(resolve(EMBEDDED))


def test_token_values_are_what_the_loss_uses():
    """At ratio 1 (old log-probs = current) and without entropy/KL terms, the loss is exactly
    ``-mean(corrected advantage)``, so the recorded ``corrected`` is the loss's token advantage."""
    graphdef, params = tiny_model()
    model = nnx.merge(graphdef, params)
    samples = make_samples((True, False, True, True))
    config = LossConfig(coef=0.8, clip=0.2, entropy_coef=0.0, chunk_size=4)
    first = OrsdLoss(config)(model, build_batch(samples, seq_multiple=16, response_multiple=4))[3]
    samples = [
        dataclasses.replace(s, old_logprobs=np.asarray(first["logp_without"][i, : len(s.response)]).tolist())
        for i, s in enumerate(samples)
    ]
    batch = build_batch(samples, seq_multiple=16, response_multiple=4)
    loss_sum, count, sums, values = OrsdLoss(config)(model, batch)
    values = {k: np.asarray(v) for k, v in values.items()}
    mask = np.asarray(batch.response_mask)
    np.testing.assert_allclose(float(loss_sum), -np.sum(values["corrected"] * mask), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(float(sums["gap"]), np.sum(values["gap"] * mask), rtol=1e-5, atol=1e-6)
    # The correction by hand from the recorded gap: A + coef * clip(gap, -c, c).
    expected = values["advantage"] + config.coef * np.clip(values["gap"], -config.clip, config.clip)
    np.testing.assert_allclose(values["corrected"] * mask, expected * mask, rtol=1e-6, atol=1e-6)
    assert np.all(values["gap"][~np.asarray(batch.has_rubric)] == 0)  # no rubric, no gap
    assert np.any(np.abs(values["gap"][np.asarray(batch.has_rubric)] * mask[np.asarray(batch.has_rubric)]) > 1e-3)
    assert np.any(values["gap_clipped"])  # clip 0.2 is small against this random model's gaps
    assert jnp.isfinite(loss_sum) and float(count) == mask.sum()


def test_recorded_credit_matches_the_run(run):
    """The run's per-token records hold every step sample of the last update with the advantage the
    loss used (recomputed here by hand from the recorded rewards) and the logged gap statistics."""
    assert recorded_updates(run) == [2]
    record = load_credit(run)
    logged = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()][1]
    assert logged["update"] == 2 and len(record.steps) == logged["train/step_samples"]
    groups = json.loads((run / "steps" / "00002" / "step.json").read_text())["groups"]
    advantage = preset("tiny").advantage
    assert advantage.invalid == "format" and not advantage.across_steps
    for g, group in enumerate(groups):
        outcome = np.array(
            [
                sum(s["reward"] - advantage.invalid_penalty * (not s["valid_format"]) for s in t["steps"])
                for t in group["trajectories"]
            ]
        )
        expected = (outcome - outcome.mean()) / (outcome.std(ddof=1) + 1e-6)
        for s in (s for s in record.steps if s.group == g):
            np.testing.assert_allclose(s.values["advantage"], expected[s.trajectory], rtol=1e-5, atol=1e-6)
    # Expert labels (ALFWorld's planner): every step has one, and an answer without an action (the
    # engine's no-op) never moves toward the goal.
    played = [s for g in groups for t in g["trajectories"] for s in t["steps"]]
    assert all(isinstance(s["expert"], bool) for s in played)
    assert not any(s["expert"] for s in played if s["action"] is None)
    assert [s.expert for s in record.steps] == [
        groups[s.group]["trajectories"][s.trajectory]["steps"][s.step]["expert"] for s in record.steps
    ]
    rubric_tokens = sum(len(s.response_ids) for s in record.steps if s.criteria is not None)
    np.testing.assert_allclose(logged["loss/rubric_token_frac"] * logged["train/tokens"], rubric_tokens, atol=1e-3)
    for s in record.steps:  # a group without a selected rubric keeps its advantage on every token
        if s.criteria is None:
            np.testing.assert_array_equal(s.values["corrected"], s.values["advantage"])
            assert not s.values["gap"].any()
    # The step samples trained on, kept for replaying the update: one per recorded step, the same
    # responses, advantages and rubric use (a rubric's tokens inserted exactly where a rubric was selected).
    samples = load_samples(run / "steps" / "00002")
    kept = sorted((tuple(s.response), round(s.advantage, 5), bool(s.insert)) for s in samples)
    credited = sorted(
        (s.response_ids, round(float(s.values["advantage"][0]), 5), s.criteria is not None) for s in record.steps
    )
    assert kept == credited


@pytest.mark.parametrize("pack_rows", [False, True])
def test_update_metrics_are_exact_over_minibatches(tmp_path, pack_rows):
    """The trainer's minibatch loop: the logged gap statistics of an update equal those of the
    recorded per-token values over all its minibatches, whose rubric shares differ."""
    graphdef, params = tiny_model()
    config = dataclasses.replace(
        preset("tiny"),
        minibatch_rows=2,
        loss=LossConfig(coef=0.8, clip=0.2, chunk_size=4),
        pack_rows=pack_rows,
        row_tokens=0,
    )
    optimizer = make_optimizer(config.optimizer)
    graphdef, state, sharding = init_train_state(nnx.merge(graphdef, params), optimizer, make_mesh(1))
    step = make_train_step(OrsdLoss(config.loss), optimizer, graphdef, sharding)
    samples = make_samples((True, True, True, False, False, True))  # minibatches with 2, 1 and 1 rubric rows
    steps = [Step(0, (i, i + 1)) for i in range(0, 6, 2)]
    trained = train_minibatches(step, state, samples, steps, config.minibatch_spec(), record=True)
    metrics, counts, recorded = trained.metrics, trained.counts, trained.recorded
    tokens = counts["tokens"]
    assert len(recorded) == 3
    # The forward reads the shared prompt once and the tail and response once per stream (two-stream
    # layout, the default): [prefix tail response] and, with a rubric, [rubric tail response].
    without = [len(s.prefix) + len(s.tail) + len(s.response) for s in samples]
    rubric = [len(s.insert) + len(s.tail) + len(s.response) if s.insert else 0 for s in samples]
    # Each stream of a minibatch of 2 rows is padded to a multiple of 128 tokens; rows of several
    # samples (pack_rows) hold both samples of a minibatch in one row here.
    rows = 1 if pack_rows else 2
    slots = sum(
        rows * -(-max(stream[k : k + 2] + [1]) // 128) * 128 for stream in (without, rubric) for k in range(0, 6, 2)
    )
    assert counts["row_tokens"] == sum(without) + sum(rubric) and counts["row_slots"] == slots
    gaps = np.concatenate(
        [
            m.values["gap"][i, : len(samples[r].response)]
            for m in recorded
            for i, r in enumerate(m.samples)
            if samples[r].insert
        ]
    )
    assert tokens == sum(len(s.response) for s in samples)
    np.testing.assert_allclose(metrics["rubric_token_frac"], len(gaps) / tokens, rtol=1e-6)
    np.testing.assert_allclose(metrics["gap_mean"], gaps.mean(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(metrics["gap_std"], gaps.std(), rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(metrics["gap_clip_frac"], np.mean(np.abs(gaps) > 0.2), atol=1e-6)


def test_token_pieces_concatenate_to_the_decoded_text(tokenizer):
    for text in ["<think></think>\n<action>go to desk 1</action>", "naïve café — 東京 🙂 ok", ""]:
        ids = tokenizer.encode(text, add_special_tokens=False)
        pieces = token_pieces(tokenizer, ids)
        assert len(pieces) == len(ids) and "".join(pieces) == tokenizer.decode(ids)
    ids = tokenizer.encode("🙂", add_special_tokens=False)
    assert len(ids) > 1 and token_pieces(tokenizer, ids)[-1] == "🙂"  # the character on the token completing it


def test_run_tokenizer_without_an_exported_policy(run, tmp_path, tokenizer):
    """A run killed before its export still names its tokenizer (through its config)."""
    (tmp_path / "config.json").write_text((run / "config.json").read_text())
    assert run_tokenizer(tmp_path).get_vocab() == tokenizer.get_vocab()


def test_missing_records_are_named(tmp_path, run):
    with pytest.raises(FileNotFoundError, match="no recorded credit"):
        load_credit(tmp_path)
    with pytest.raises(FileNotFoundError, match="update 1 .* was not recorded; recorded: \\[2\\]"):
        load_credit(run, 1)


def test_notebook_runs_top_to_bottom(run, tmp_path, tokenizer):
    notebook = nbformat.read(REPO / "notebooks" / "credit_maps.ipynb", as_version=4)
    env = {"ORSD_RUN": str(run), "ORSD_NOTEBOOK_OUT": str(tmp_path)}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # the kernel inherits this process's environment
    try:
        NotebookClient(
            notebook, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(REPO)}}
        ).execute()
    finally:
        for k, v in old.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    image = Image.open(tmp_path / "credit_map.png")
    assert image.width > 200 and image.height > 100
    shown = json.loads((tmp_path / "credit_map.json").read_text())
    steps = json.loads((run / "steps" / "00002" / "step.json").read_text())["groups"]
    assert shown
    for entry in shown:
        g, t, s = entry["key"]
        ids = steps[g]["trajectories"][t]["steps"][s]["response_ids"]
        assert entry["response_ids"] == ids and "".join(entry["pieces"]) == tokenizer.decode(ids)
        assert len(entry["gap"]) == len(ids)
    outputs = [o for cell in notebook.cells if cell.cell_type == "code" for o in cell.outputs]
    assert any("image/png" in o.get("data", {}) for o in outputs)  # the map was drawn
    assert not any(o.get("output_type") == "error" for o in outputs)


class _Responses(html.parser.HTMLParser):
    """Text of every ``div.response`` of a DOM, keyed by its ``data-key``, and its token spans."""

    def __init__(self):
        super().__init__()
        self.text: dict[str, str] = {}
        self.spans: dict[str, int] = {}
        self._key, self._depth = None, 0

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "div" and "response" in (attrs.get("class") or "").split():
            self._key, self._depth = attrs["data-key"], 0
            self.text[self._key], self.spans[self._key] = "", 0
        elif self._key is not None:
            self._depth += 1
            self.spans[self._key] += tag == "span"

    def handle_endtag(self, tag):
        if self._key is not None:
            if self._depth == 0:
                self._key = None
            else:
                self._depth -= 1

    def handle_data(self, data):
        if self._key is not None:
            self.text[self._key] += data


def test_html_report_in_headless_chromium(run, tmp_path, tokenizer):
    page = write_report(run, out=tmp_path / "report.html")
    parser = _Responses()
    parser.feed(rendered_dom(page))
    steps = json.loads((run / "steps" / "00002" / "step.json").read_text())["groups"]
    record = load_credit(run)
    assert len(parser.text) == len(record.steps)
    for s in record.steps:
        key = f"{s.group}-{s.trajectory}-{s.step}"
        ids = steps[s.group]["trajectories"][s.trajectory]["steps"][s.step]["response_ids"]
        assert parser.text[key] == tokenizer.decode(ids) and parser.spans[key] == len(ids)
    marks = sum(1 for s in record.steps if s.expert), sum(1 for s in record.steps if s.expert is False)
    dom = rendered_dom(page)
    assert (dom.count("(expert step)"), dom.count("(not an expert step)")) == marks
    png = screenshot(page, tmp_path / "report.png", width=1000, height=900)
    pixels = np.asarray(Image.open(png).convert("RGB")).astype(int)
    assert pixels.shape == (900, 1000, 3)
    assert (pixels.sum(axis=2) < 200).sum() > 2000  # dark text was laid out, not a blank page


HOSTILE = '</span></div><script>document.title="pwned"</script><img src=x onerror=alert(1)>" title="x'


def test_hostile_text_renders_no_element(tmp_path):
    """Model- and environment-written text in every field of the page stays text in Chromium's DOM,
    and the page forbids scripts and remote loads."""
    from orsd_jax.credit import CreditRecord, GroupRecord, StepCredit
    from orsd_jax.credit_html import render

    values = {k: np.array([0.5, -0.5]) for k in ("logp_with", "logp_without", "gap", "advantage", "corrected")}
    values["gap_clipped"] = np.array([False, True])
    step = StepCredit(
        0, 0, 0, HOSTILE, HOSTILE, HOSTILE, (1, 2), (HOSTILE, HOSTILE), True, 10.0, (HOSTILE,), values, True
    )
    long = dataclasses.replace(step, step=1, observation=HOSTILE * 8)  # folded (a WebShop page's length)
    group = GroupRecord(HOSTILE, (10.0,), ((HOSTILE, HOSTILE), ()), (0.5, None), 0, HOSTILE)
    page = tmp_path / "hostile.html"
    page.write_text(render(CreditRecord(1, (group,), (step, long)), clip=1.0, title=HOSTILE))
    dom = rendered_dom(page)
    assert "Content-Security-Policy" in page.read_text() and "default-src 'none'" in page.read_text()
    assert "<script" not in dom and "<img" not in dom
    assert dom.count("&lt;script&gt;") >= 6 + 8  # the text itself is shown, the folded one whole


def test_long_observations_are_folded_above_the_responses():
    """A WebShop results page folds under its first line (the whole text inside ``<details>``, closed);
    an ALFWorld observation stays shown whole; the response tokens are shown either way."""
    from orsd_jax.credit import CreditRecord, GroupRecord, StepCredit
    from orsd_jax.credit_html import render

    values = {k: np.array([0.5]) for k in ("logp_with", "logp_without", "gap", "advantage", "corrected")}
    values["gap_clipped"] = np.array([False])
    page_text = "Back to Search [SEP] Page 1 (Total results: 50) [SEP] " + " [SEP] ".join(
        f"B0{i:08d}" for i in range(300)
    )
    short = StepCredit(0, 0, 0, "task", "You are in the middle of a room.", "a", (1,), ("a",), True, 10.0, None, values)
    folded = dataclasses.replace(short, step=1, observation=page_text)
    html_text = render(
        CreditRecord(1, (GroupRecord("task", (10.0,), (), (), None, "constant rewards"),), (short, folded)), 1.0
    )
    parser = _Responses()
    parser.feed(html_text)
    assert parser.text == {"0-0-0": "a", "0-0-1": "a"}
    assert '<p class="observation">step 0: You are in the middle of a room.</p>' in html_text
    details = html_text.split('<details class="observation">')[1].split("</details>")[0]
    assert details.startswith(f"<summary>step 1: {page_text[:120]} ... ({len(page_text)} characters)</summary>")
    assert details.endswith(page_text) and " open" not in details.split(">")[0]


def test_gap_colours():
    assert gap_colour(0.0, 1.0) == "rgba(37, 99, 235, 0.000)"
    assert gap_colour(0.5, 1.0) == "rgba(37, 99, 235, 0.375)"
    assert gap_colour(-3.0, 1.0) == "rgba(220, 38, 38, 0.750)"  # saturates at the clip
