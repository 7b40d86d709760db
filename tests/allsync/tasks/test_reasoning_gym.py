"""task.name reasoning_gym: problems from the reasoning-gym package, scored with its own score_answer."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from allsync.config import ConfigError, parse_config
from allsync.tasks import reasoning_gym_splits
from evals.reward_pool import RewardPool, RewardSpec
from evals.rewards import answer_of, is_correct_score, score

CHAIN_SUM = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}


def test_splits_hold_out_questions_and_keep_metadata():
    splits, report = reasoning_gym_splits(
        "chain_sum", CHAIN_SUM, train_size=300, heldout_size=20, template=None, seed=3
    )
    held = {p.prompt for p in splits.heldout}
    assert len(held) == 20 and len(splits.train) == 300
    assert not held & {p.prompt for p in splits.train}  # no held-out question is trained on
    unique = len({p.prompt for p in splits.train})
    assert report == [f"reasoning-gym chain_sum: 300 training rows ({unique} unique questions), 20 held-out questions"]
    p = splits.heldout[0]
    assert p.metadata["source_dataset"] == "chain_sum" and eval(p.metadata["expression"]) == int(p.answer)  # noqa: S307
    again, _ = reasoning_gym_splits("chain_sum", CHAIN_SUM, 300, 20, None, seed=3)
    assert again == splits  # the seed fixes the splits
    other, _ = reasoning_gym_splits("chain_sum", CHAIN_SUM, 300, 20, None, seed=4)
    assert other.heldout != splits.heldout
    templated, _ = reasoning_gym_splits("chain_sum", CHAIN_SUM, 300, 20, "Q: {problem}", seed=3)
    assert templated.heldout[0].prompt == "Q: " + p.prompt


def test_small_generator_space_is_an_error():
    with pytest.raises(ValueError, match=r"question space is too small"):
        reasoning_gym_splits(
            "chain_sum", CHAIN_SUM, train_size=10, heldout_size=201, template=None, seed=0
        )  # a +- b: 200 questions


def test_reasoning_gym_reward_uses_the_generators_score_answer():
    splits, _ = reasoning_gym_splits("chain_sum", CHAIN_SUM, 10, 5, None, seed=0)
    p = next(q for q in splits.heldout if q.answer.startswith("-"))  # a negative answer: signs matter
    meta = p.metadata
    assert score("reasoning_gym", f"Answer: {p.answer}", p.answer, meta) == 1.0
    assert (
        score("reasoning_gym", f"so <answer>{p.answer}</answer>", p.answer, meta) == 1.0
    )  # reasoning-gym's own format
    assert score("reasoning_gym", f"Answer: {p.answer}.0", p.answer, meta) == 1.0  # chain_sum accepts trailing decimals
    assert score("reasoning_gym", f"Answer: {p.answer[1:]}", p.answer, meta) == 0.0  # sign dropped
    assert score("reasoning_gym", "no answer", p.answer, meta) == 0.0
    assert answer_of("reasoning_gym", f"x\nAnswer: {p.answer}") == p.answer
    assert is_correct_score("reasoning_gym", 1.0) and not is_correct_score(
        "reasoning_gym", 0.5
    )  # partial credit is not solved
    with pytest.raises(ValueError, match=r"needs the task entry's metadata"):
        score("reasoning_gym", "Answer: 1", "1")
    with RewardPool(RewardSpec("reasoning_gym")) as pool:  # metadata crosses to the reward process as JSON
        results = pool.score(
            [
                (f"Answer: {p.answer}", {"prompt": p.prompt, "answer": p.answer, "metadata": meta}),
                ("Answer: 1000", {"prompt": p.prompt, "answer": p.answer, "metadata": meta}),
            ]
        )
    assert [r.score for r in results] == [1.0, 0.0]


def test_reasoning_gym_task_config_is_checked():
    ok = {
        "task": {"name": "reasoning_gym", "dataset": "chain_sum", "dataset_args": CHAIN_SUM},
        "reward": {"name": "reasoning_gym"},
    }
    assert parse_config(ok).task.dataset_args == CHAIN_SUM
    assert parse_config({"task": ok["task"]}).reward.name == "reasoning_gym"  # the task's default_reward
    with pytest.raises(ConfigError, match=r"reward.name = 'arithmetic' with task.name = 'reasoning_gym'"):
        parse_config({"task": ok["task"], "reward": {"name": "arithmetic"}})
    with pytest.raises(ConfigError, match=r"reward.name = 'reasoning_gym' with task.name = 'arithmetic'"):
        parse_config({"reward": {"name": "reasoning_gym"}})
    with pytest.raises(ConfigError, match=r"task.dataset = 'no_such_task': Dataset 'no_such_task' not registered"):
        parse_config({**ok, "task": {"name": "reasoning_gym", "dataset": "no_such_task"}})
    with pytest.raises(
        ConfigError, match=r"task.dataset_args \{'digits': 3\} for reasoning-gym chain_sum: .*unexpected keyword"
    ):
        parse_config({**ok, "task": {"name": "reasoning_gym", "dataset": "chain_sum", "dataset_args": {"digits": 3}}})
    with pytest.raises(ConfigError, match=r"task.name reasoning_gym needs task.dataset"):
        parse_config({**ok, "task": {"name": "reasoning_gym"}})
    with pytest.raises(ConfigError, match=r"task.ops is set but task.name is reasoning_gym"):
        parse_config({**ok, "task": {**ok["task"], "ops": ["*"]}})
    with pytest.raises(ConfigError, match=r"task.dataset is set but task.name is arithmetic"):
        parse_config({"task": {"dataset": "chain_sum"}})


@pytest.mark.slow  # issue 70: whole runs of many seconds go to the slow lane, which CI runs after the default one
def test_the_recipe_trains_on_a_reasoning_gym_task(warm_tiny, tmp_path):
    config = {
        "model": {"base": str(warm_tiny), "quant": {"routed_experts": "nf4"}},
        "lora": {"rank": 8, "alpha": 16},
        "rollout": {"prompts_per_step": 4, "group_size": 4, "max_new_tokens": 12},
        "parallel": {"workers_per_node": 1},
        "task": {
            "name": "reasoning_gym",
            "dataset": "chain_sum",
            "dataset_args": CHAIN_SUM,
            "train_size": 200,
            "heldout_size": 8,
        },
        "reward": {"name": "reasoning_gym"},
        "run": {
            "out_dir": str(tmp_path / "out"),
            "steps": 2,
            "eval_every": 2,
            "checkpoint_every": 2,
            "eval_samples": 2,
        },
    }
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(config))
    recipe = Path(__file__).parents[3] / "recipes" / "dapo.py"
    done = subprocess.run(
        [sys.executable, str(recipe), "--config", str(path), "--no-ray"], capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "reasoning-gym chain_sum: 200 training rows" in done.stdout
    records = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert max(r["step"] for r in records) == 2
    # the final held-out evaluation is written as `allsync eval` writes it, and its avg@2 is the logged accuracy
    summary = json.loads((tmp_path / "out" / "eval" / "summary.json").read_text())
    samples = [json.loads(line) for line in (tmp_path / "out" / "eval" / "samples.jsonl").read_text().splitlines()]
    assert summary["problems"] == 8 and summary["n"] == 2 and len(samples) == 16
    assert summary["avg@2"] == sum(s["correct"] for s in samples) / 16
    assert summary["avg@2"] == [r for r in records if "heldout_accuracy" in r][-1]["heldout_accuracy"]
    assert all(s["correct"] == (s["score"] == 1.0) for s in samples)


def test_warm_start_supervises_the_runs_own_task():
    from allsync.tasks import ArithmeticGenerator, ReasoningGymGenerator

    rg = parse_config(
        {
            "model": {"warm_start": True},
            "task": {
                "name": "reasoning_gym",
                "dataset": "chain_sum",
                "dataset_args": CHAIN_SUM,
                "template": "Q: {problem}",
            },
            "reward": {"name": "reasoning_gym"},
        }
    ).task
    assert rg.warm_start_task() == ReasoningGymGenerator("chain_sum", CHAIN_SUM, "Q: {problem}")
    # the warm start's held-out problems are the run's: drawn first, whatever the number of training problems
    spec = ReasoningGymGenerator("chain_sum", CHAIN_SUM)
    assert spec.splits(400, 20, 0).heldout == spec.splits(100, 20, 0).heldout
    assert parse_config({"task": {"min_digits": 2, "max_digits": 2}}).task.warm_start_task() == ArithmeticGenerator(
        2, 2, ("+",)
    )
    with pytest.raises(ConfigError, match=r"model.warm_start with task.name dataset"):
        parse_config(
            {"model": {"warm_start": True}, "task": {"name": "dataset", "train_files": ["a"], "eval_files": ["b"]}}
        )
