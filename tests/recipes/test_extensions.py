"""A contributor's extensions in their own modules only (tests/fixtures/: a task, a policy loss, an advantage
estimator with whole-batch sums and a producer), named by a config's run.imports: the recipe runs them at two
workers, the estimator's two workers make one worker's update, and the checks ask their entries."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from allsync.config import ConfigError, parse_config
from tests.allsync.test_update_correctness import PROBLEMS, groups, trained

RECIPE = Path(__file__).parents[2] / "recipes" / "dapo.py"
FIXTURES = ["tests.fixtures.reverse_word", "tests.fixtures.sequence_loss", "tests.fixtures.batch_baseline"]
EXTENSIONS = FIXTURES + ["tests.fixtures.hinted_turn"]


def extension_config(base: Path, out_dir: Path, workers: int = 2) -> dict:
    return {
        "model": {"base": str(base), "quant": {"routed_experts": "nf4"}},
        "lora": {"rank": 4, "alpha": 8},
        "rollout": {"prompts_per_step": 4, "group_size": 4, "max_new_tokens": 16},
        "algorithm": {
            "advantage": "batch_mean_baseline",
            "policy_loss": "gspo",
            "loss_agg": "seq-mean-token-mean",
            "dynamic_sampling": False,
        },
        "optim": {"lr": 1e-3, "minibatches": 2},
        "parallel": {"workers_per_node": workers},
        "task": {"name": "reverse_word", "train_size": 200, "heldout_size": 8},
        "producer": {"kind": "hinted"},
        "run": {"out_dir": str(out_dir), "steps": 2, "eval_every": 2, "export": "merged", "imports": EXTENSIONS},
    }


@pytest.mark.slow  # issue 70: whole runs of many seconds go to the slow lane, which CI runs after the default one
def test_the_fixture_extensions_run_two_steps_at_two_workers(warm_tiny, ray_cluster, tmp_path):
    """recipes/dapo.py with the four fixture modules at two Ray workers (each worker imports run.imports): 2 steps,
    the GSPO loss's own statistic logged under its name, the clipped loss's absent."""
    out = tmp_path / "out"
    config = tmp_path / "extensions.yaml"
    config.write_text(yaml.safe_dump(extension_config(warm_tiny, out)))
    env = {**os.environ, "RAY_ADDRESS": ray_cluster}
    done = subprocess.run(
        [sys.executable, str(RECIPE), "--config", str(config)], capture_output=True, text=True, timeout=600, env=env
    )
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    trained_rows = [r for r in rows if r.get("trained_tokens")]
    assert [r["step"] for r in trained_rows] == [1, 2]
    assert all("sequence_clipfrac" in r and "clipfrac_high" not in r for r in trained_rows)


def test_the_fixture_estimator_on_two_workers_makes_the_one_worker_update(tiny_bf16):
    """batch_mean_baseline's baseline is the whole batch's mean reward: two Ray workers holding groups of different
    rewards sum their batch_sums and apply the one-worker gradient (without the sums they would not: each half's
    own mean differs).

    Every entry is bounded. The gradients agree within float32's reordering noise (1e-3 of the largest entry; a
    half's own mean moves them by ~its size). One AdamW step (one minibatch, no weight decay) moves an entry by
    lr * g / (|g| + eps): two gradients g1, g2 of one sign give steps at most lr * eps * |g1 - g2| / ((|g1| + eps)
    (|g2| + eps)) apart, and of opposite signs (only where |g1 - g2| >= |g1|) at most 2 lr; plus the last bits
    of the step and of the parameter (the dtype's eps of each)."""
    from allsync.launch.ray_actors import RayGroup

    def config(workers):
        return parse_config(
            {
                "model": {"base": str(tiny_bf16), "quant": {"routed_experts": "nf4"}},
                "lora": {"rank": 4, "alpha": 8},
                "run": {"export": "merged", "imports": FIXTURES},
                "rollout": {"prompts_per_step": 4, "group_size": 3, "max_new_tokens": 6},
                "optim": {"lr": 1e-3, "minibatches": 1},
                "parallel": {"workers_per_node": workers},
                "algorithm": {"advantage": "batch_mean_baseline", "dynamic_sampling": False},
            }
        )

    from allsync.run.worker import RLWorker

    samples, index = groups(0, 4, spread=True)
    single = RLWorker(config(1), PROBLEMS)
    flat = lambda tensors: torch.cat([t.detach().flatten() for t in tensors])  # noqa: E731
    start = flat(single.parameter_tensors())  # in the gradients' order
    trained(single, samples, index)
    pair = RayGroup(config(2), PROBLEMS)
    try:
        import ray

        ray.get(
            [
                pair.workers[0].train.remote(samples[:6], index[:6]),
                pair.workers[1].train.remote(samples[6:], index[6:] - 2),
            ]
        )
        got, got_grad = (flat(pair.call_ranks([0], method)[0]) for method in ("parameter_tensors", "gradient_tensors"))
    finally:
        pair.shutdown()
    expected, expected_grad = flat(single.parameter_tensors()), flat(single.gradient_tensors())
    assert float((got_grad - expected_grad).abs().max()) < 1e-3 * float(expected_grad.abs().max())
    lr, eps = 1e-3, single.policy.optimizer.param_groups[0]["eps"]
    same_sign = expected_grad.sign() == got_grad.sign()
    apart = lr * eps * (got_grad - expected_grad).abs() / ((got_grad.abs() + eps) * (expected_grad.abs() + eps))
    # the last bits: AdamW's step is ~6 float operations (moments, bias corrections, sqrt, eps, divide), each within
    # half an ulp of the step, and the sum with the parameter within half an ulp of it
    rounding = 4 * torch.finfo(expected.dtype).eps * (expected.abs() + lr)
    bound = torch.where(same_sign, apart, torch.full_like(apart, 2 * lr)) + rounding
    diff = (got - expected).abs()
    assert float((expected - start).abs().gt(0.5 * lr).float().mean()) > 0.5  # most entries moved by ~lr
    assert bool((diff <= bound).all()), f"{int((diff > bound).sum())} of {diff.numel()} entries past their bound"


def test_the_checks_ask_the_fixture_entries(tiny_bf16):
    """The loss's entry says its aggregation, the registry names the new estimator, a bad run.imports is named."""
    base = {"model": {"base": str(tiny_bf16)}, "run": {"imports": FIXTURES}}
    with pytest.raises(
        ConfigError, match=r"algorithm.policy_loss gspo with the aggregation token-mean .*seq-mean-token-mean"
    ):
        parse_config({**base, "algorithm": {"policy_loss": "gspo"}})
    with pytest.raises(
        ConfigError, match=r"algorithm.clip_c = 3.0 with algorithm.policy_loss gspo: the loss does not read"
    ):
        parse_config({**base, "algorithm": {"policy_loss": "gspo", "loss_agg": "seq-mean-token-mean", "clip_c": 3.0}})
    with pytest.raises(ConfigError, match=r"algorithm.advantage: unknown advantage 'nope'.*batch_mean_baseline"):
        parse_config({**base, "algorithm": {"advantage": "nope"}})
    with pytest.raises(ConfigError, match=r"run.imports: cannot import 'tests.fixtures.nothing_here'"):
        parse_config({"run": {"imports": ["tests.fixtures.nothing_here"]}})
    for name in ("", " ", ".reverse_word", "..fixtures"):  # importlib raises ValueError / TypeError on these
        with pytest.raises(ConfigError, match=r"run\.imports: .* is not an absolute module name"):
            parse_config({"run": {"imports": [name]}})
    task = parse_config({**base, "task": {"name": "reverse_word", "max_letters": 4}}).task
    splits, _ = task.splits()
    assert all(p.answer == p.prompt.split(": ")[1][::-1] and len(p.answer) <= 4 for p in splits.heldout)


def test_a_copy_of_the_default_config_with_another_task_is_refused_where_its_replies_do_not_fit(tiny_bf16):
    """tiny_cpu.yaml with only task: reverse_word (4-6 letters): `Answer: fedcba` + eos is 15 tokens, and the overlong
    window (max_len 16, cache_len 4) penalizes replies past 12, so correct answers would lose reward: refused naming
    the keys; with the window moved, rollout.max_new_tokens 16 still holds it; at 14 it would be cut."""
    from transformers import AutoTokenizer

    from allsync.config import check_reply_budget, read_yaml

    data = read_yaml(Path(__file__).parents[2] / "recipes" / "configs" / "tiny_cpu.yaml")
    data["model"] = {**data["model"], "base": str(tiny_bf16), "warm_start": False}
    data["run"] = {**data["run"], "imports": ["tests.fixtures.reverse_word"]}
    data["task"] = {"name": "reverse_word", "min_letters": 4, "max_letters": 6, "train_size": 50, "heldout_size": 20}
    tokenizer = AutoTokenizer.from_pretrained(tiny_bf16)

    def check(**changes):
        config = parse_config({**data, **changes})
        splits, _ = config.task.splits()
        check_reply_budget(config, tokenizer, splits.train + splits.heldout, "copy.yaml")

    with pytest.raises(
        ConfigError, match=r"algorithm.overlong.max_len = 16 and cache_len = 4 .* longest correct reply is 15"
    ):
        check()
    algorithm = {**data["algorithm"], "overlong": {"max_len": 16, "cache_len": 1, "factor": 1.0}}
    check(algorithm=algorithm)
    with pytest.raises(ConfigError, match=r"rollout.max_new_tokens = 14 .* 15 tokens with eos"):
        check(algorithm={**algorithm, "overlong": None}, rollout={**data["rollout"], "max_new_tokens": 14})
