"""The methods as the paper and verl-agent run them: normalisation per (method, environment), the
penalty rule and timing, the selection target, the WebShop reward, mini-batches, evaluation splits,
Qwen3 prompts, what the rubric writer sees, and distinct criteria. Every expected value is worked
out by hand here from verl-agent's rules, not read back from the code."""

import dataclasses

import numpy as np
import pytest

from experiments.common import plan
from orsd_jax.advantages import AdvantageConfig, rank_targets, returns, step_advantages
from orsd_jax.config import ABLATIONS, ENVS, METHODS, preset
from orsd_jax.envs.base import Task
from orsd_jax.rollout import Group, Step, Trajectory
from orsd_jax.rubrics import parse_bundle, rubric_metrics, select_bundle
from orsd_jax.rubrics.render import render_group

PAPER = ("paper-qwen3-1.7b", "paper-qwen3-4b")


def _step(reward=0.0, valid_format=True, admissible=True, observation="o", action="look"):
    return Step("u", (1,), (2,), (-0.1,), "r", observation, action, valid_format, admissible, reward, False, 0)


def _group(*trajectories):
    task = Task("alfworld", "k", "look", "look at a book under the desklamp")
    return Group(
        task, tuple(Trajectory(task, tuple(steps), any(s.reward for s in steps), 0.0) for steps in trajectories)
    )


# 1. verl-agent's normalisation: GRPO divides by the group's std everywhere
# (norm_adv_by_std_in_grpo=True); GiGPO runs mean_std_norm on ALFWorld and mean_norm on WebShop.
VERL_AGENT_STD = {(m, e): not (m == "gigpo" and e == "webshop") for m in METHODS for e in ENVS}


@pytest.mark.parametrize("name", PAPER)
@pytest.mark.parametrize("env", ENVS)
@pytest.mark.parametrize("method", METHODS)
def test_paper_presets_normalise_as_verl_agent(name, env, method):
    config = dataclasses.replace(preset(name, env), method=method).resolved()
    assert config.advantage.normalize_std is VERL_AGENT_STD[(method, env)]


def test_webshop_grpo_advantages_are_std_normalised():
    """A WebShop group with one win of four: GRPO gives (10 - 2.5) / std = 1.5, not 7.5."""
    config = dataclasses.replace(preset("paper-qwen3-1.7b", "webshop"), method="grpo").resolved()
    group = _group([_step(10.0)], [_step()], [_step()], [_step()])
    adv = step_advantages([group], "grpo", config.advantage)
    std = np.std([10, 0, 0, 0], ddof=1)
    np.testing.assert_allclose(np.concatenate(adv[0]), np.array([7.5, -2.5, -2.5, -2.5]) / (std + 1e-6), rtol=1e-9)
    gigpo = dataclasses.replace(preset("paper-qwen3-1.7b", "webshop"), method="gigpo").resolved()
    assert not gigpo.advantage.normalize_std  # mean only: 7.5, -2.5, ... before the step part


# 6. What an invalid answer is.


def test_invalid_rule_format_or_admissible():
    """One trajectory won in 2 steps, the other lost with a well-formed but inadmissible command."""
    group = _group([_step(), _step(10.0)], [_step(admissible=False), _step()])
    fmt = AdvantageConfig(normalize_std=False, invalid="format")
    adm = AdvantageConfig(normalize_std=False, invalid="admissible")
    # Per trajectory, mean only: format rule 10 and 0 -> +-5; admissible rule 10 and -0.1 -> +-5.05.
    np.testing.assert_allclose(np.concatenate(step_advantages([group], "grpo", fmt)[0]), [5, 5, -5, -5], rtol=1e-12)
    np.testing.assert_allclose(
        np.concatenate(step_advantages([group], "grpo", adm)[0]), [5.05, 5.05, -5.05, -5.05], rtol=1e-12
    )
    broken = _group([_step(), _step(10.0)], [_step(valid_format=False, admissible=False), _step()])
    np.testing.assert_allclose(returns(broken, fmt), [10, -0.1], rtol=1e-12)
    with pytest.raises(ValueError, match="invalid-answer rule"):
        AdvantageConfig(invalid="tags")
    assert all(preset(n, e).advantage.invalid == "format" for n in PAPER for e in ENVS)


# 7. GiGPO's penalty is subtracted from the step return after discounting.


def test_gigpo_penalty_after_discounting_by_hand():
    # t0: rewards 0, 10, its second answer malformed; t1: rewards 0, 10. Anchors: both first steps
    # "start", both second steps "mid". Returns (gamma 0.95): t0 9.5, 10 - 0.1 = 9.9; t1 9.5, 10.
    # (Penalising before discounting would give t0 0.95 * 9.9 = 9.405 at its first step.)
    group = _group(
        [_step(observation="start"), _step(10.0, valid_format=False, observation="mid")],
        [_step(observation="start"), _step(10.0, observation="mid")],
    )
    config = AdvantageConfig(normalize_std=False, invalid="format")
    adv = step_advantages([group], "gigpo", config)
    # Episode (per trajectory, mean only): 9.9 and 10 -> -0.05, +0.05. Step: start {9.5, 9.5} -> 0,
    # mid {9.9, 10} -> -0.05, +0.05.
    np.testing.assert_allclose(adv[0][0], [-0.05, -0.1], atol=1e-12)
    np.testing.assert_allclose(adv[0][1], [0.05, 0.1], atol=1e-12)
    # Across steps (verl-agent): episode values per sample 10, 9.9, 10, 10 (mean 9.975).
    across = step_advantages([group], "gigpo", dataclasses.replace(config, across_steps=True))
    np.testing.assert_allclose(np.concatenate(across[0]), [0.025, -0.075 - 0.05, 0.025, 0.025 + 0.05], atol=1e-12)


# 3. What selection ranks.


def test_selection_ranks_outcomes_in_the_paper_presets():
    """Outcomes all 0 but different invalid answers: the paper's target gives no rubric (constant
    rewards); ranking returns gives one."""
    group = _group([_step()], [_step(valid_format=False)], [_step(valid_format=False), _step(valid_format=False)])
    advantage = AdvantageConfig(normalize_std=True)
    np.testing.assert_array_equal(rank_targets(group, "outcome", advantage), [0, 0, 0])
    np.testing.assert_allclose(rank_targets(group, "return", advantage), [0, -0.1, -0.2], rtol=1e-12)
    satisfaction = np.array([[0.9, 0.5, 0.1]])
    rng = np.random.default_rng(0)
    assert (
        select_bundle(satisfaction, rank_targets(group, "outcome", advantage), "spearman", rng).reason
        == "constant rewards"
    )
    assert select_bundle(satisfaction, rank_targets(group, "return", advantage), "spearman", rng).index == 0
    assert all(preset(n, e).rubric.rank_by == "outcome" for n in PAPER for e in ENVS)
    assert preset("cpu-demo").rubric.rank_by == "return"


# 4. The WebShop reward.


def test_webshop_reward_success_or_score(webshop_data):
    from orsd_jax.envs.webshop import WebShopEnv, load_goals

    task = load_goals(webshop_data, "test")[0]
    bought = {}
    for reward in ("success", "score"):
        env = WebShopEnv(webshop_data, reward=reward)
        env.reset(task)
        env.step("search[pillow cover]")
        env.step("click[b0743jkhbv]")  # the goal's product, bought without choosing its options
        bought[reward] = env.step("click[buy now]")
    assert bought["success"].score == pytest.approx(0.8) and not bought["success"].won
    assert bought["success"].reward == 0.0 and bought["score"].reward == pytest.approx(8.0)
    assert all(preset(n, "webshop").env.reward == "success" for n in PAPER)
    with pytest.raises(ValueError, match="unknown reward"):
        dataclasses.replace(
            preset("tiny", "webshop"), env=dataclasses.replace(preset("tiny", "webshop").env, reward="x")
        )


# 5 and the dry run: every paper preset prints the protocol.


@pytest.mark.parametrize("name", PAPER)
@pytest.mark.parametrize("env", ENVS)
def test_dry_run_prints_the_protocol(name, env):
    alfworld = env == "alfworld"
    report, fits = plan(preset(name, env))
    rows, samples = (256, 64 * 50) if alfworld else (64, 64 * 15)
    assert fits
    for line in (
        "reward: success (10 x success); invalid answers (format rule) cost 0.1",
        "advantage: GRPO, mean-std normalisation over the group's step samples",
        "KL to the initial policy: k3, coefficient 0.01",
        "replay: two-stream layout; the PPO ratio's old log-probs from the trainer",
        f"mini-batch: {rows} step samples, 1 PPO epoch(s); optimizer steps per update: 1 to {-(-samples // rows)} "
        f"(64 to {samples} step samples)",
        "rubric selection: spearman, rank-correlated with the group's outcomes",
        f"evaluation: {'valid_seen, valid_unseen' if alfworld else 'test'}",
    ):
        assert line in report, (line, report)
    gigpo, _ = plan(dataclasses.replace(preset(name, env), method="gigpo"))
    assert f"advantage: GiGPO, {'mean-std' if alfworld else 'mean-only'} normalisation" in gigpo


# 8. Evaluation in and out of distribution.


def test_evaluation_covers_both_alfworld_splits():
    assert preset("cpu-demo").eval_splits == ("valid_seen", "valid_unseen")
    assert preset("paper-qwen3-4b", "webshop").eval_splits == ("test",)
    with pytest.raises(ValueError, match="unknown alfworld splits"):
        dataclasses.replace(preset("tiny"), env=dataclasses.replace(preset("tiny").env, eval_splits=("test",)))


# 9. Qwen3's template pre-fills an empty think block when thinking is off.

# A chat template with Qwen3's generation prompt (built here: nothing is downloaded).
QWEN3_STYLE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)


class _Answers:
    """A sampler that answers every prompt with the same text, as a non-thinking Qwen3 would."""

    max_model_len = 4096
    weight_version = 0

    def __init__(self, tokenizer, text):
        self.tokenizer, self.text = tokenizer, text

    def generate(self, prompts, params, groups=None):
        from orsd_jax.sampling.base import Completion

        ids = tuple(self.tokenizer.encode(self.text, add_special_tokens=False))
        return [Completion(ids, (-0.5,) * len(ids), self.text, "stop") for _ in prompts for _ in range(params.n)]


def test_qwen3_prompts_reach_valid_answers(tmp_path):
    """The whole path on a real generated game: the template's prompt, the sampled answer, the
    parser and the engine. A non-thinking answer ``<action>look</action>`` after the pre-filled
    think block is a valid step."""
    from transformers import AutoTokenizer

    from orsd_jax import chat
    from orsd_jax.envs import EnvPool
    from orsd_jax.envs.alfworld import AlfworldEnv, build_prompt, default_games, load_split
    from orsd_jax.models import EMBEDDED, resolve
    from orsd_jax.rollout import RolloutConfig, collect_groups

    tokenizer = AutoTokenizer.from_pretrained(resolve(EMBEDDED))
    tokenizer.chat_template = QWEN3_STYLE
    fmt = chat.chat_format(tokenizer, thinking=False)
    assert fmt.prefill == "<think>\n\n</think>\n\n"
    assert tokenizer.decode(list(fmt.tail)).endswith("assistant\n<think>\n\n</think>\n\n")
    assert chat.chat_format(tokenizer, thinking=True).prefill == ""
    task = load_split(default_games("easy", 0, 8, 4), "valid_seen", ("look",))[0]
    with EnvPool(AlfworldEnv, n_envs=2, n_workers=1) as pool:
        groups, stats = collect_groups(
            _Answers(tokenizer, "<action>look</action>"),
            pool,
            [task],
            2,
            RolloutConfig(max_steps=2),
            seed=0,
            tokenizer=tokenizer,
            fmt=fmt,
            build_prompt=build_prompt,
        )
    steps = [s for t in groups[0].trajectories for s in t.steps]
    assert len(steps) == 4 and all(s.valid_format and s.admissible for s in steps) and stats.invalid_answers == 0
    assert all(s.prompt_ids[-len(fmt.tail) :] == fmt.tail for s in steps)


# 10. The rubric writer sees the steps, not the outcome.


def test_writer_headers_do_not_state_the_outcome():
    won = [_step(action="go to desk 1"), _step(10.0, action="use desklamp 1")]
    lost = [_step(action="go to desk 1"), _step(action="go to shelf 1"), _step(action="look")]
    count = lambda s: len(s.split())  # noqa: E731
    text = render_group(_group(won, lost).trajectories, 200, count)
    assert "Attempt 1:\n" in text and "Attempt 2:\n" in text
    assert "steps)" not in text and "2 steps" not in text and "3 steps" not in text
    # The same steps with the outcomes swapped render the same text: only the steps tell.
    swapped = [Trajectory(t.task, t.steps, not t.won, 1.0 - t.score) for t in _group(won, lost).trajectories]
    assert render_group(swapped, 200, count) == text


# 11. Distinct criteria.


def test_repeated_criteria_count_once():
    steps = "\n".join(f"{k}. Step {k}: take laptop 1 from sidetable 1" for k in range(1, 9))
    bundle = parse_bundle(steps)
    assert not bundle.valid and bundle.criteria == ("Step 1: take laptop 1 from sidetable 1",)
    assert bundle.repeats == 7 and "1 distinct criteria (7 repeated)" in bundle.reason
    ordinals = ["First, go to the desk 1", "Then go to the desk 1", "Finally, go to the desk 1"]
    assert len(parse_bundle("\n".join(f"- {c}" for c in ordinals)).criteria) == 1
    # Wording variants repeat; other objects or receptacles do not.
    distinct = [
        "Goes to the desk 1 first",
        "Goes to the drawer 1 first",
        "Takes the laptop from the sidetable",
        "Uses the desklamp while holding the statue",
        "Uses the desklamp while holding the book",
    ]
    variants = [*distinct, "Take the laptop from the side table", "goes to the desk 1 first!"]
    parsed = parse_bundle("\n".join(f"{k}. {c}" for k, c in enumerate(variants, start=1)))
    assert parsed.valid and parsed.criteria == tuple(distinct) and parsed.repeats == 2
    from orsd_jax.rubrics import GroupRubric, Selection

    results = [
        GroupRubric((bundle, parsed), np.full((2, 1), np.nan), Selection(None, np.full(2, np.nan), "no valid bundle"))
    ]
    metrics = rubric_metrics(results)
    assert metrics["rubric/repeated_criteria"] == 9 and metrics["rubric/rejected_with_repeats"] == 1


# 12. The paper's ablations: ORSD with one switch of the rubric stage, nothing else changed.


@pytest.mark.parametrize("env", ENVS)
@pytest.mark.parametrize("method", [m for m in METHODS if m.startswith("orsd-")])
def test_an_ablation_is_orsd_with_its_rubric_switches(env, method):
    orsd = dataclasses.replace(preset("paper-qwen3-1.7b", env), method="orsd").resolved()
    ablation = dataclasses.replace(orsd, method=method).resolved()
    assert dataclasses.replace(ablation, method="orsd", rubric=orsd.rubric) == orsd
    changed = {
        f.name: getattr(ablation.rubric, f.name)
        for f in dataclasses.fields(orsd.rubric)
        if getattr(ablation.rubric, f.name) != getattr(orsd.rubric, f.name)
    }
    # The paper's two WebShop ablations by hand: a single bundle (one candidate, kept without
    # selection) and a random one of the K; the others change what ABLATIONS says, and something.
    paper = {"orsd-single": {"candidates": 1, "selection": "single"}, "orsd-random": {"selection": "random"}}
    assert changed and changed == paper.get(method, ABLATIONS[method])
