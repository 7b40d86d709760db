"""recipes/dapo.py launched the ways users launch it, 2 CPU processes each: torchrun, accelerate launch (SPMD:
each process one worker, rank 0 the controller, no Ray) and the Ray mode log the same metrics for 3 steps.
A checkpoint written at expert_parallel 2 (SPMD) resumes at expert_parallel 1 (Ray) and logs the steps an
uninterrupted expert_parallel 1 run logs."""

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.recipes.test_dapo_recipe import metrics, recipe_main

ROOT = Path(__file__).parents[2]
RECIPE = ROOT / "recipes" / "dapo.py"
ACCELERATE_CPU = ROOT / "recipes" / "accelerate" / "cpu_2proc.yaml"
EXACT = {
    "samples_generated",
    "correct_sum",
    "groups_kept",
    "groups_generated",
    "trained_samples",
    "trained_tokens",
    "heldout_accuracy",
    "heldout_greedy_accuracy",
    "optimizer_steps",
    "sampling_rounds",
    "response_tokens",
}


def run_config(base: Path, out_dir: Path, expert_parallel: int = 1) -> dict:
    """2 workers, dynamic sampling on (ranks refill in different numbers of rounds), 2 minibatches."""
    return {
        "model": {"base": str(base), "quant": {"routed_experts": "nf4"}},
        "lora": {"rank": 8, "alpha": 16},
        "rollout": {"prompts_per_step": 4, "group_size": 4, "max_new_tokens": 12},
        "algorithm": {"dynamic_sampling": True, "max_sampling_rounds": 3},
        "optim": {"lr": 1e-3, "minibatches": 2},
        "parallel": {"workers_per_node": 2, "expert_parallel": expert_parallel},
        "task": {"min_digits": 1, "max_digits": 1, "train_size": 400, "heldout_size": 20},
        "run": {"out_dir": str(out_dir), "steps": 3, "eval_every": 3, "checkpoint_every": 2, "export": "merged"},
    }


def write_config(path: Path, base: Path, out_dir: Path, expert_parallel: int = 1) -> Path:
    path.write_text(yaml.safe_dump(run_config(base, out_dir, expert_parallel)))
    return path


def launch(kind: str, config: Path, *extra: str, ray_address: str | None = None) -> subprocess.CompletedProcess:
    """recipes/dapo.py under `kind`; the Ray mode starts its own cluster, or joins `ray_address` (RAY_ADDRESS)."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"} | (
        {"RAY_ADDRESS": ray_address} if ray_address else {}
    )
    prefix = {
        "ray": [sys.executable],
        "torchrun": [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            "2",
        ],  # a free port each
        "accelerate": [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(ACCELERATE_CPU)],
    }[kind]
    return subprocess.run(
        [*prefix, str(RECIPE), "--config", str(config), *extra], capture_output=True, text=True, timeout=600, env=env
    )


@pytest.fixture(scope="module")
def ray_run(warm_tiny, tmp_path_factory):
    out = tmp_path_factory.mktemp("ray") / "out"
    done = launch("ray", write_config(out.parent / "c.yaml", warm_tiny, out))
    assert done.returncode == 0, done.stderr[-3000:]
    return out


@pytest.mark.slow  # issue 70: whole runs of many seconds go to the slow lane, which CI runs after the default one
@pytest.mark.parametrize(
    "kind", ["torchrun", "accelerate"]
)  # torchrun stays in the default run through the vLLM rollout and the two-node launch
def test_spmd_launchers_log_the_ray_metrics(kind, warm_tiny, ray_run, tmp_path):
    out = tmp_path / "out"
    done = launch(kind, write_config(tmp_path / "c.yaml", warm_tiny, out))
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("held-out accuracy: base ") == 1  # rank 0 alone reports
    assert "Ray" not in done.stdout + done.stderr.replace("recipes/dapo.py", "")  # no cluster was started
    got, want = metrics(out), metrics(ray_run)
    assert sorted(got) == sorted(want) == [0, 1, 2, 3]
    for step in want:
        assert got[step] == want[step], f"step {step} differs between {kind} and Ray"
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["latest", "step-000002"]


@pytest.mark.slow  # issue 70: whole runs of many seconds go to the slow lane, which CI runs after the default one
def test_checkpoint_at_ep2_resumes_at_ep1(warm_tiny, ray_run, ray_cluster, tmp_path):
    out = tmp_path / "out"
    done = launch("torchrun", write_config(tmp_path / "ep2.yaml", warm_tiny, out, expert_parallel=2), "--steps", "2")
    assert done.returncode == 0, done.stderr[-3000:]
    done = launch(
        "ray",
        write_config(tmp_path / "ep1.yaml", warm_tiny, out, expert_parallel=1),
        "--resume",
        ray_address=ray_cluster,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "(step 2)" in done.stdout
    got, want = metrics(out), metrics(ray_run)
    assert sorted(got) == [0, 1, 2, 3]
    # steps 1-2 at EP 2, step 3 at EP 1 from the EP 2 checkpoint: the samples and updates of the run that never
    # stopped. The EP 2 run evaluated at its last step before its checkpoint; evaluation draws from its own random
    # stream, so step 3 samples what the uninterrupted run samples (before, it drew from the run's, and one token of
    # 48 differed at step 3)
    for step in (1, 2, 3):
        for key, value in want[step].items():
            if key in EXACT:
                assert got[step][key] == value, (step, key)
            elif isinstance(value, float) and not key.startswith("logprob_gap"):  # the same sums in another order
                assert math.isclose(got[step][key], value, rel_tol=1e-4, abs_tol=1e-6), (
                    step,
                    key,
                    got[step][key],
                    value,
                )
    assert got[3]["logprob_gap"] < 1e-4  # every rank loaded the adapter its engine samples with


def launched_as_rank_0_of_2(monkeypatch) -> None:
    """The environment torchrun --nproc_per_node 2 gives its first process (what recipes/dapo.py reads through
    allsync.launch.spmd.spmd_environment); the refusals below run the recipe's main in this process with it, as the
    recipe refuses before any work (the launches above run torchrun itself)."""
    for key, value in {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(key, value)


def test_launcher_world_size_must_match_the_config(warm_tiny, tmp_path, monkeypatch, capsys):
    config = write_config(tmp_path / "c.yaml", warm_tiny, tmp_path / "out")
    data = yaml.safe_load(config.read_text())
    data["parallel"]["workers_per_node"] = 4
    data["rollout"]["prompts_per_step"] = 8
    config.write_text(yaml.safe_dump(data))
    launched_as_rank_0_of_2(monkeypatch)
    code, stderr = recipe_main(["--config", config], capsys)
    assert code != 0
    assert "the launcher started 2 processes (WORLD_SIZE) but parallel.nodes x workers_per_node = 4" in stderr
    assert not (tmp_path / "out").exists()


def test_no_ray_under_a_launcher_is_refused(warm_tiny, tmp_path, monkeypatch, capsys):
    launched_as_rank_0_of_2(monkeypatch)
    code, stderr = recipe_main(
        ["--config", write_config(tmp_path / "c.yaml", warm_tiny, tmp_path / "out"), "--no-ray"], capsys
    )
    assert code != 0
    assert "--no-ray under torchrun / accelerate launch" in stderr
    assert not (tmp_path / "out").exists()


def with_drill(config: Path, fault: dict, **run) -> Path:
    data = yaml.safe_load(config.read_text())
    data["health"] = {"faults": [fault]}
    data["run"].update(run)
    config.write_text(yaml.safe_dump(data))
    return config


def trained_steps(out_dir: Path) -> list[int]:
    """The steps metrics.jsonl holds a training record for, in file order (evaluations are separate records)."""
    return [r["step"] for r in map(json.loads, (out_dir / "metrics.jsonl").read_text().splitlines()) if "reward" in r]


@pytest.mark.slow  # issue 70: whole runs of many seconds go to the slow lane, which CI runs after the default one
def test_a_worker_killed_mid_step_is_replaced_and_the_run_logs_the_uninterrupted_metrics(
    warm_tiny, ray_run, ray_cluster, tmp_path
):
    """Worker 1 SIGKILLs itself in step 3's generate phase; the controller stops the step, starts new workers from
    the step-2 checkpoint and finishes: every step once, each equal to the uninterrupted run's."""
    out = tmp_path / "out"
    config = with_drill(
        write_config(tmp_path / "c.yaml", warm_tiny, out), {"kind": "kill", "rank": 1, "step": 3}, max_restarts=1
    )
    done = launch("ray", config, ray_address=ray_cluster)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "worker 1 failed in step" in done.stderr and "Restart 1 of run.max_restarts = 1" in done.stderr
    assert "resumed from" in done.stdout and "(step 2)" in done.stdout
    assert trained_steps(out) == [1, 2, 3]
    got, want = metrics(out), metrics(ray_run)
    for step in want:
        assert got[step] == want[step], f"step {step} differs after the restart"
    events = [json.loads(line) for line in (out / "health.jsonl").read_text().splitlines()]
    restarts = [e for e in events if e["event"] == "restart"]
    assert len(restarts) == 1 and restarts[0]["cause"].startswith("worker 1 failed in step")
    reports = [json.loads(line) for line in (out / "workers.jsonl").read_text().splitlines()]
    assert [r["step"] for r in reports] == [1, 2, 3]  # the lost step's attempt left no record behind
    for r in reports:  # every worker's health signals, each step
        assert len(r["workers"]) == 2
        for w in r["workers"]:
            assert w["generate_tokens_per_second"] > 0 and w["train_tokens_per_second"] > 0 and w["rss_bytes"] > 2**20
            assert 0 < w["cpu_percent"] < 400 and math.isfinite(w["local_grad_norm"]) and w["probe_seconds"] < 0.05


@pytest.mark.slow  # 13 s; restarts stay in the default run: test_a_worker_killed_mid_step_is_replaced_...
def test_a_lost_worker_beyond_max_restarts_ends_the_run(warm_tiny, ray_cluster, tmp_path):
    config = with_drill(
        write_config(tmp_path / "c.yaml", warm_tiny, tmp_path / "out"), {"kind": "kill", "rank": 0, "step": 1}
    )
    done = launch("ray", config, ray_address=ray_cluster)
    assert done.returncode == 4
    assert "error: worker 0 failed in step" in done.stderr and "every worker was stopped" in done.stderr


@pytest.mark.slow  # ~46 s, 30 of them waiting for run.step_timeout; a lost worker's restart stays in the default run
def test_a_hung_spmd_process_exits_for_the_elastic_launcher_which_restarts_and_resumes(warm_tiny, ray_run, tmp_path):
    """torchrun --max-restarts 1: rank 1 hangs in step 3; past run.step_timeout both processes exit with code 75,
    torchrun starts them again, and they resume from the step-2 checkpoint by themselves."""
    out = tmp_path / "out"
    config = with_drill(
        write_config(tmp_path / "c.yaml", warm_tiny, out),
        {"kind": "hang", "rank": 1, "step": 3, "seconds": 600},
        step_timeout=30,  # a step takes < 1 s here, a few on a loaded machine (12 s was passed under load)
        max_restarts=1,
    )
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            "2",
            "--max-restarts",
            "1",
            str(RECIPE),
            "--config",
            str(config),
        ],
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "step 3 passed run.step_timeout = 30 s; exiting with code 75" in done.stderr
    assert "resumed from" in done.stdout and "(step 2)" in done.stdout
    assert trained_steps(out) == [1, 2, 3]
    got, want = metrics(out), metrics(ray_run)
    for step in want:
        assert got[step] == want[step], f"step {step} differs after the elastic restart"


@pytest.mark.slow
def test_a_hung_ray_worker_passes_the_step_timeout_and_is_replaced(warm_tiny, ray_run, ray_cluster, tmp_path):
    out = tmp_path / "out"
    config = with_drill(
        write_config(tmp_path / "c.yaml", warm_tiny, out),
        {"kind": "hang", "rank": 0, "step": 3, "seconds": 600},
        max_restarts=1,
        step_timeout=30,
    )
    done = launch("ray", config, ray_address=ray_cluster)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "no answer from worker(s) 0, 1 within run.step_timeout = 30 s" in done.stderr
    assert trained_steps(out) == [1, 2, 3]
    got, want = metrics(out), metrics(ray_run)
    for step in want:
        assert got[step] == want[step], f"step {step} differs after the restart"


def two_node_config(path: Path, base: Path, out_dir: Path) -> Path:
    """The launcher tests' run as 2 nodes x 1 worker: the same 2 workers, so the same metrics."""
    data = run_config(base, out_dir)
    data["parallel"].update(nodes=2, workers_per_node=1)
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.mark.slow  # issue 70: whole runs of many seconds go to the slow lane, which CI runs after the default one
def test_two_torchrun_nodes_log_the_ray_metrics(warm_tiny, ray_run, tmp_path):
    """Multi-node SPMD as users start it: one torchrun per node with --nnodes 2 --node_rank i and a shared
    rendezvous endpoint (both "nodes" on this machine). Each process is LOCAL_RANK 0 of its node, and RANK 0's
    node alone writes the run's files."""
    from allsync.launch.group import free_port

    out = tmp_path / "out"
    config = two_node_config(tmp_path / "c.yaml", warm_tiny, out)
    port = str(free_port())
    nodes = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes",
                "2",
                "--node_rank",
                str(i),
                "--nproc_per_node",
                "1",
                "--rdzv_backend",
                "static",
                "--master_addr",
                "127.0.0.1",
                "--master_port",
                port,
                str(RECIPE),
                "--config",
                str(config),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]
    outputs = [node.communicate(timeout=600) for node in nodes]
    for node, (stdout, stderr) in zip(nodes, outputs):
        assert node.returncode == 0, stderr[-3000:]
    assert outputs[0][0].count("held-out accuracy: base ") == 1 and "held-out accuracy" not in outputs[1][0]
    got, want = metrics(out), metrics(ray_run)
    assert sorted(got) == sorted(want) == [0, 1, 2, 3]
    for step in want:
        assert got[step] == want[step], f"step {step} differs between 2 torchrun nodes and Ray"


@pytest.mark.slow  # 31 s; multi-node stays in the default run: two torchrun nodes, and the rank-to-node rule below
def test_a_two_node_ray_cluster_logs_the_single_node_metrics(warm_tiny, ray_run, tmp_path):
    """The Ray mode joining a cluster through RAY_ADDRESS, as after `ray start --head` and `ray start --address`
    on another node: two Ray nodes of 1 CPU each (both on this machine), so each worker lands on its own node, and
    rank 0's TCP store is opened on its node's address."""
    import os

    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    try:
        nodes = [cluster.add_node(num_cpus=1) for _ in range(2)]
        cluster.wait_for_nodes()
        out = tmp_path / "out"
        config = two_node_config(tmp_path / "c.yaml", warm_tiny, out)
        done = subprocess.run(
            [sys.executable, str(RECIPE), "--config", str(config)],
            capture_output=True,
            text=True,
            timeout=600,
            env={**os.environ, "RAY_ADDRESS": cluster.address},
        )
        assert done.returncode == 0, done.stderr[-3000:]
        assert len({n.unique_id for n in nodes}) == 2
        assert re.search(r"Ray: 2 workers on 2 nodes: [\d.]+ ranks 0; [\d.]+ ranks 1\n", done.stdout), done.stdout[:500]
    finally:
        cluster.shutdown()
    got, want = metrics(out), metrics(ray_run)
    assert sorted(got) == sorted(want) == [0, 1, 2, 3]
    for step in want:
        assert got[step] == want[step], f"step {step} differs between a 2-node Ray cluster and 1 node"


def test_each_nodes_ranks_are_consecutive_whatever_bundles_ray_gave_it():
    """Ray's PACK strategy does not promise that bundle i sits next to bundle i+1: ranks are dealt to bundles so
    that every node's ranks are consecutive (an expert-parallel group of 8 on 8-GPU nodes stays in one node)."""
    from allsync.launch.ray_actors import placement_summary, rank_ranges, ranks_to_bundles

    assert ranks_to_bundles({0: "A", 1: "B", 2: "A", 3: "B"}) == [0, 2, 1, 3]
    interleaved = {b: "AB"[b % 2] for b in range(16)}  # two 8-GPU nodes, bundles alternating between them
    bundles = ranks_to_bundles(interleaved)
    assert sorted(bundles) == list(range(16)) and bundles[0] == 0  # a permutation; rank 0 keeps bundle 0
    node_of_rank = [interleaved[b] for b in bundles]
    assert node_of_rank == ["A"] * 8 + ["B"] * 8
    assert ranks_to_bundles({1: "B", 0: "B", 2: "A"}) == [0, 1, 2]  # the node of bundle 0 comes first
    assert (
        placement_summary(node_of_rank, {"A": "10.0.0.1", "B": "10.0.0.2"})
        == "Ray: 16 workers on 2 nodes: 10.0.0.1 ranks 0-7; 10.0.0.2 ranks 8-15"
    )
    assert (
        rank_ranges([8, 0, 1, 2, 5, 7]) == "0-2, 5, 7-8"
        and rank_ranges([3]) == "3"
        and rank_ranges(list(range(48))) == "0-47"
    )


@pytest.mark.parametrize(
    "launcher, config, nodes, per_node",
    [
        ("cpu_2proc.yaml", "tiny_cpu.yaml", 1, 2),
        ("gpu_1node_8.yaml", None, 1, 8),
        ("h100_6x8.yaml", "dapo_math_deepseek_v3_671b.yaml", 6, 8),
        ("h100_6x8.yaml", "dapo_math_deepseek_v3_671b_torch_engine.yaml", 6, 8),
        ("h100_6x8.yaml", "memory_agent_deepseek_v3_671b_48xh100.yaml", 6, 8),
    ],
)
def test_shipped_accelerate_configs_start_the_world_the_recipe_config_plans(launcher, config, nodes, per_node):
    """What `accelerate launch --config_file recipes/accelerate/X.yaml --machine_rank 3 ...` hands torchrun (its
    own argument handling, no process started): nnodes x nproc_per_node, equal to the paired recipe config's
    parallel.nodes x workers_per_node, which the recipe checks against WORLD_SIZE at start."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_multi_gpu_env

    rank = "3"
    node = ["--machine_rank", rank, "--main_process_ip", "10.1.2.3"] if nodes > 1 else []
    args = launch_command_parser().parse_args(
        ["--config_file", str(ROOT / "recipes" / "accelerate" / launcher), *node, str(RECIPE)]
    )
    args, _, _ = _validate_launch_command(args)
    prepare_multi_gpu_env(args)  # fills torchrun's arguments in
    assert int(args.nproc_per_node) == per_node
    if nodes > 1:  # one machine: no --nnodes, torchrun's default of 1
        assert (int(args.nnodes), str(args.node_rank), args.rdzv_endpoint) == (nodes, rank, "10.1.2.3:29500")
    else:
        assert not hasattr(args, "nnodes")
    if config is not None:
        parallel = yaml.safe_load((ROOT / "recipes" / "configs" / config).read_text())["parallel"]
        assert (parallel.get("nodes", 1), parallel["workers_per_node"]) == (nodes, per_node)
