"""DAPO with LoRA on a frozen, quantized DeepSeek-V3, all-sync: the same workers generate and learn.

    python recipes/dapo.py [--config recipes/configs/tiny_cpu.yaml] [--resume]         # Ray: one worker per device
    torchrun --nproc_per_node N recipes/dapo.py --config ...                           # SPMD: one process per device
    accelerate launch --config_file recipes/accelerate/cpu_2proc.yaml recipes/dapo.py --config ...

Ray mode: this process is the controller and places parallel.nodes x workers_per_node worker actors (it
joins the cluster at RAY_ADDRESS when set). SPMD mode (the launcher set RANK and WORLD_SIZE): every process
is one worker, rank 0 also does the controller's work, and Ray is never started. --no-ray: one worker in this
process. The modes live in allsync/launch/.

This one loop runs every algorithm and producer. Per step, on every worker (allsync/run/worker.py): the producer
(allsync/producers/, producer.kind: single-turn groups, T-PPO windows, multi-conversation episodes, tool agents)
makes episodes with the current adapter and scores them (rewards + shaping, dynamic sampling keeping groups with
mixed rewards) -> the learner (allsync/update/learner.py) turns them into advantages (algorithm.advantage: group
baselines, or a critic's GAE / EGAE) and makes minibatch updates of the LoRA tensors with the policy loss
(algorithm.policy_loss; gradients all-reduced) -> adapter sync to the engine. This script is the controller: it
validates the config, builds (or reuses) the warm-started base, starts the workers, evaluates held-out accuracy,
logs, checkpoints, and exports the adapter.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from tqdm.auto import tqdm

from allsync.config import (
    ConfigError,
    RunConfig,
    check_kv_room,
    check_reply_budget,
    config_with_model_checks,
    load_config,
)
from allsync.metrics import MetricsLog, aggregate, plot_run
from allsync.run.checkpoint import (
    CheckpointStateError,
    earlier_run_files,
    latest_good_checkpoint,
    prune_checkpoints,
    unseen_probes,
    write_manifest,
)
from allsync.health.detector import HealthMonitor, make_detector
from allsync.launch.group import launch_mode
from allsync.launch.spmd import elastic_attempt, spmd_environment, spmd_state
from evals.report import write_evaluation
from quant.checkpoint_io import atomic_output_dir, atomic_write_text, read_config

DEFAULT_CONFIG = Path(__file__).parent / "configs" / "tiny_cpu.yaml"


def ensure_base(config: RunConfig) -> None:
    """The frozen base: an existing checkpoint, or the tiny model after its supervised warm start (built
    once, then reused while its stored settings equal this allsync's)."""
    if not config.model.warm_start:
        if not (Path(config.model.base) / "config.json").exists():
            raise ConfigError(
                f"model.base = {config.model.base!r}: no checkpoint there (set model.warm_start: true to build the tiny one)"
            )
        return
    from allsync.warm_start import settings_for_run, warm_start

    try:  # supervised on the run's own task and seed: the problems RL holds out are never its training data
        warm_start(config.model.base, settings_for_run(config))
    except FileExistsError as exc:
        raise ConfigError(
            f"model.base = {config.model.base!r} with model.warm_start: {exc}. A base is built for one "
            "task and task.seed (an older allsync may have built it too): give model.base another directory "
            "for this run, or delete it to rebuild"
        ) from exc


def heldout_evaluation(group, problems, samples: int, memory: str = "own") -> tuple[dict, list]:
    """Every worker's share of `problems`, `samples` responses each, summarized as `allsync eval` does
    (evals.report: avg@n, pass@k, maj@n, ...); and the sample records. memory: multi-conversation episodes
    answer from their own memory, a blank one or the task's gold one (the ablation)."""
    from evals.report import SampleRecord, summarize_samples

    records = [SampleRecord(**r) for share in group.call("evaluate", problems, samples, memory) for r in share]
    return summarize_samples(records, samples), records


def heldout_accuracy(group, problems, samples: int, memory: str = "own") -> float:
    """avg@samples (greedy accuracy for samples = 1)."""
    return heldout_evaluation(group, problems, samples, memory)[0][f"avg@{samples}"]


def metric_name(config: RunConfig) -> str:
    n = config.run.eval_samples
    return "greedy" if n == 1 else f"avg@{n} at temperature {config.rollout.temperature:g}"


def save_checkpoint(group, out_dir: Path, step: int, extra: dict) -> Path:
    """Adapter, optimizer, RNG states and data positions of every worker, written atomically. Under SPMD the
    other ranks write their parts into the controller's temporary directory (`call` passes rank 0's
    arguments), and the all-gather at the end of `call` waits for every part before it is renamed."""
    path = out_dir / "checkpoints" / f"step-{step:06d}"
    if not group.is_controller:
        group.call("save_state", None)
        return path
    with atomic_output_dir(path, overwrite=True) as tmp:
        group.call("save_state", str(tmp))
        (tmp / "controller.json").write_text(json.dumps({"step": step, **extra}))
        write_manifest(tmp)  # last: a directory without it was cut short
    atomic_write_text(out_dir / "checkpoints" / "latest", path.name)  # for people; resume checks the manifests
    return path


def unshared_out_dir(group, out_dir: Path) -> str | None:
    """Every worker writes a probe file into run.out_dir as its node sees it; None when the controller sees all
    of them, else what is wrong (checkpoint parts of the ranks it cannot see would be lost: multi-node runs need
    run.out_dir on a filesystem every node mounts). The same answer on every rank."""
    import shutil
    import uuid

    probe = out_dir / f".probe-{uuid.uuid4().hex}" if group.is_controller else None
    hosts = group.call("write_probe", str(probe))  # SPMD: every rank gets the controller's path
    problem = None
    if group.is_controller:
        if unseen := unseen_probes(probe, hosts):
            problem = (
                f"run.out_dir = {str(out_dir)!r} is not shared between the nodes: the controller "
                f"({hosts[0]}) does not see the files of {', '.join(unseen[:4])}, so their checkpoint parts "
                "would be lost; put run.out_dir on a filesystem every node mounts"
            )
        shutil.rmtree(probe, ignore_errors=True)
    return group.agree(problem)


def refuse(problem, rank: int) -> int:
    """Print the problem that stops the run before any work, on every rank (each finds or agreed on the same one):
    under torchrun the first rank to exit gets the others killed, so a refusal printed by rank 0 alone could be
    lost. Returns the exit code, 2."""
    print(f"error{f' (rank {rank})' if rank else ''}: {problem}", file=sys.stderr, flush=True)
    return 2


def latest_checkpoint(out_dir: Path, among: set[str] | None = None) -> Path | None:
    """The newest checkpoint whose files match its manifest (of the names `among`, when given); a refused newer
    one is named in a warning."""
    return latest_good_checkpoint(out_dir / "checkpoints", among=among)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=str(DEFAULT_CONFIG))
    parser.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in run.out_dir")
    parser.add_argument("--steps", type=int, help="override run.steps")
    parser.add_argument("--out-dir", help="override run.out_dir")
    parser.add_argument("--no-ray", action="store_true", help="run one worker in this process")
    args = parser.parse_args(argv)
    launched = spmd_environment()  # (rank, world size, local rank) under torchrun / accelerate launch
    rank = launched[0] if launched else 0

    try:  # every config problem is reported before any work starts
        config = load_config(args.config)
        if args.steps:
            config.run.steps = args.steps
        if args.out_dir:
            config.run.out_dir = args.out_dir
        # the base's config.json and tokenizer, or those of the base the warm start would build: every check that reads
        # them runs before any work (a warm start takes minutes)
        planned = base_for_checks(config)
        if planned is not None:
            config_with_model_checks(config, planned[0], args.config)
        mode = launch_mode(launched is not None, args.no_ray, config)  # allsync/launch/: SPMD, local or Ray
        if (problem := mode.refusal(config, args.no_ray, launched[1] if launched else None)) is not None:
            raise ConfigError(f"{args.config}: {problem}")
        restarts = config.run.max_restarts or config.run.step_timeout is not None
        if args.no_ray and restarts and rank == 0:  # the flag asks for one in-process worker: say what it turns off
            print(
                f"note: --no-ray: run.max_restarts = {config.run.max_restarts} and run.step_timeout = {config.run.step_timeout} "
                "do not apply (a lost worker is this process; nothing could restart it)",
                file=sys.stderr,
            )
            config.run.max_restarts, config.run.step_timeout = 0, None
        if config.parallel.layout != "colocated":
            raise ConfigError(
                f"{args.config}: parallel.layout = {config.parallel.layout!r}: recipes/dapo.py runs all-sync "
                "(colocated); the disaggregated layout is the baseline in benchmarks/allsync.py"
            )
        if launched:
            spmd_state(config)  # the process group, so that rank 0 alone builds the base while the others wait
        resume = args.resume or (launched is not None and elastic_attempt() > 0)  # an elastic launcher's restart
        try:
            splits, reports = config.task.splits()
        except ValueError as exc:  # evals.datasets.DatasetError names file:row and key
            raise ConfigError(f"{args.config}: task: {exc}") from exc
        if planned is not None:
            max_model_len = engine_model_len(config, *planned, splits.train + splits.heldout, args.config)

        def prepare() -> None:  # on rank 0: it alone sees the controller's out_dir on a multi-node run
            if not resume and (files := earlier_run_files(Path(config.run.out_dir))):
                raise ConfigError(
                    f"run.out_dir = {config.run.out_dir!r} holds an earlier run ({', '.join(files[:3])}"
                    f"{', ...' if len(files) > 3 else ''}): --resume continues it (a finished run is evaluated "
                    "and exported again); or give another directory (--out-dir DIR or run.out_dir), or delete it"
                )
            ensure_base(config)

        rank0_first(prepare, launched)
        if read_config(config.model.base) != planned[0]:  # the base built or reused is the one checked
            raise ConfigError(
                f"{args.config}: model.base = {config.model.base!r} with model.warm_start: its config.json is not the "
                "one this allsync's warm start writes for these settings (an older allsync built it?); delete it to "
                "rebuild, or give model.base another directory"
            )
        if rank == 0:
            for line in reports:
                print(line)
    except ConfigError as exc:
        return refuse(exc, rank)

    out_dir = Path(config.run.out_dir)

    def run_training(group, resume: bool, own: set[str] | None) -> int:
        return train(config, resume, group, splits, out_dir, own)

    return mode.run(config, splits.train, max_model_len, run_training, resume, out_dir)


def rank0_first(build, launched) -> None:
    """Run `build` on rank 0 only (SPMD) and let the other ranks go on once it is done; a ConfigError it
    raises is raised on every rank. Without a launcher, just run it."""
    if not launched:
        build()
        return
    import torch.distributed as dist

    box = [None]
    if launched[0] == 0:
        try:
            build()
        except ConfigError as exc:
            box = [str(exc)]
    dist.broadcast_object_list(box, src=0)
    if box[0] is not None:
        raise ConfigError(box[0])


def base_for_checks(config: RunConfig) -> tuple[dict, object] | None:
    """model.base's config.json and tokenizer; with model.warm_start, those of the base the warm start builds or
    reuses (moe_lora.tiny.planned_tiny: they follow from its settings alone, and a cached base is reused only when
    its settings are these), nothing written. None when there is no base and none to build (`ensure_base` refuses
    it, after the config's own refusals)."""
    if config.model.warm_start:
        from allsync.warm_start import settings_for_run
        from moe_lora.tiny import planned_tiny

        return planned_tiny(settings_for_run(config).model)
    if not (Path(config.model.base) / "config.json").exists():
        return None
    from transformers import AutoTokenizer

    return read_config(config.model.base), AutoTokenizer.from_pretrained(config.model.base)


def engine_model_len(config: RunConfig, model_config: dict, tokenizer, problems, source: str) -> int:
    """The longest sequence the run's producer can build (its settings' model_len), checked against the
    checkpoint's max_position_embeddings and against the torch engine's KV room (rollout.kv_cache_tokens); and the
    task's longest correct reply against rollout.max_new_tokens and the overlong window
    (allsync.config.check_reply_budget)."""
    check_reply_budget(config, tokenizer, problems, source)
    try:
        model_len = config.producer.model_len(
            config, tokenizer, problems, model_config.get("max_position_embeddings", 0)
        )
    except ValueError as exc:
        raise ConfigError(f"{source}: {exc} of {config.model.base}") from exc
    check_kv_room(config, model_len, source)
    return model_len


def train(config: RunConfig, resume: bool, group, splits, out_dir: Path, own: set[str] | None = None) -> int:
    """Evaluate the base, run the RL steps (checkpoints, evaluations), evaluate and export the adapter. `own`
    collects the names of the checkpoints this run resumed from or wrote; when it holds some, resuming takes
    only those (a restart after a lost worker). Under
    SPMD every rank runs this in step (the same results from `group.call`, the controller's clock through
    `group.agree`) and only the controller (rank 0) writes and prints."""
    ctl = group.is_controller
    say = print if ctl else (lambda *a, **k: None)
    if (problem := unshared_out_dir(group, out_dir)) is not None:
        return refuse(problem, getattr(group, "rank", 0))
    start_step, base_accuracy, nan_run = 0, None, 0
    checkpoint = None
    if resume and ctl:  # rank 0 verifies the manifests; every rank loads what it chose, or stops with it
        try:
            checkpoint = latest_checkpoint(out_dir, among=own or None)
        except CheckpointStateError as exc:
            checkpoint = exc
    checkpoint = group.agree(checkpoint)
    if isinstance(checkpoint, CheckpointStateError):
        return refuse(checkpoint, getattr(group, "rank", 0))
    if checkpoint is not None:
        group.call("load_state", str(checkpoint))
        state = json.loads((checkpoint / "controller.json").read_text())
        start_step, base_accuracy = state["step"], state["base_accuracy"]
        nan_run = state.get("nan_run", 0)  # non-finite steps in a row before the checkpoint
        say(f"resumed from {checkpoint} (step {start_step})")
        if own is not None:
            own.add(checkpoint.name)
    log = MetricsLog(out_dir, resume_step=start_step if checkpoint is not None else None) if ctl else None
    record = log.write if ctl else (lambda step, metrics: None)
    monitor = (
        HealthMonitor(out_dir, make_detector(config.health), start_step if checkpoint is not None else None, log.tb)
        if ctl
        else None
    )
    if base_accuracy is None:
        base_summary, base_samples = heldout_evaluation(group, splits.heldout, config.run.eval_samples)
        if ctl:  # the base's samples beside the trained adapter's (eval/): what RL changed, reply by reply
            write_evaluation(out_dir / "eval-base", base_samples, base_summary)
        base_accuracy, base_tools = base_summary[f"avg@{config.run.eval_samples}"], base_summary.get("tool_call_rate")
        base_greedy = heldout_accuracy(group, splits.heldout, 1)
        record(
            0,
            {
                "heldout_accuracy": base_accuracy,
                "heldout_greedy_accuracy": base_greedy,
                "heldout_mean_tokens": base_summary["mean_tokens"],
                **({"heldout_tool_call_rate": base_tools} if base_tools is not None else {}),
            },
        )
    else:
        base_greedy, base_tools = state.get("base_greedy"), state.get("base_tools")
    say(f"held-out accuracy of the warm-started base: {100 * base_accuracy:.1f}% ({metric_name(config)})")

    started, accuracy, tools, step = time.time(), base_accuracy, base_tools, start_step
    limit = config.run.time_limit_minutes
    bar = tqdm(range(start_step + 1, config.run.steps + 1), desc="RL steps", unit="step", disable=not ctl)
    for step in bar:
        reports = group.step(step)
        metrics = aggregate(reports)
        for alarm in monitor.observe(step, reports) if monitor is not None else []:  # allsync/health/detector.py
            tqdm.write(f"health: {alarm.describe()}", file=sys.stderr)
            bar.set_description(f"RL steps (alarm: worker {alarm.rank} at step {step})")
        nan_run = nan_run + 1 if metrics["nan_steps"] else 0
        if step % config.run.eval_every == 0 or step == config.run.steps:
            summary, samples = heldout_evaluation(group, splits.heldout, config.run.eval_samples)
            accuracy = metrics["heldout_accuracy"] = summary[f"avg@{config.run.eval_samples}"]
            metrics["heldout_mean_tokens"] = summary["mean_tokens"]
            if "tool_call_rate" in summary:  # tool agents: how often an episode called a tool
                tools = metrics["heldout_tool_call_rate"] = summary["tool_call_rate"]
            if ctl and step == config.run.steps:  # the trained adapter's samples, summary and plot
                write_evaluation(out_dir / "eval", samples, summary)
        record(step, metrics)
        bar.set_postfix(
            reward=f"{metrics.get('reward', float('nan')):.2f}",
            heldout=f"{100 * accuracy:.1f}%",
            entropy=f"{metrics.get('entropy', float('nan')):.2f}",
        )
        out_of_time = group.agree(limit is not None and time.time() - started > 60 * limit)
        if step % config.run.checkpoint_every == 0 or nan_run >= config.run.max_consecutive_nan:
            saved = save_checkpoint(
                group,
                out_dir,
                step,
                {
                    "base_accuracy": base_accuracy,
                    "base_greedy": base_greedy,
                    "nan_run": nan_run,
                    "base_tools": base_tools,
                },
            )
            if own is not None:
                own.add(saved.name)
            if ctl:
                prune_checkpoints(out_dir / "checkpoints", config.run.keep_checkpoints)
        if nan_run >= config.run.max_consecutive_nan:
            if ctl:
                print(
                    f"error: {nan_run} consecutive steps with a non-finite loss; stopped after a checkpoint",
                    file=sys.stderr,
                )
            return 3
        if out_of_time and step < config.run.steps:
            accuracy = heldout_accuracy(group, splits.heldout, config.run.eval_samples)
            record(step, {"heldout_accuracy": accuracy})
            if ctl:
                print(
                    f"warning: run.time_limit_minutes ({limit} min) reached after step {step} of {config.run.steps}: "
                    "this machine is slower than the one the step count was chosen on, and the result is not the "
                    "reproducible one",
                    file=sys.stderr,
                )
            break
    bar.close()

    greedy = heldout_accuracy(group, splits.heldout, 1)
    record(step, {"heldout_greedy_accuracy": greedy})
    ablation = {  # multiconv: how much the answers owe to the memory the episodes wrote (blank, gold)
        mode: heldout_accuracy(group, splits.heldout, config.run.eval_samples, mode)
        for mode in config.producer.memory_ablations
    }
    if ablation:
        record(step, {f"heldout_accuracy_{mode}_memory": accuracy for mode, accuracy in ablation.items()})
    tensors = group.call_for_rank0("full_adapter_tensors")  # every rank: expert blocks are gathered
    group.shutdown()  # before the summary, so that nothing the workers print comes after it
    if not ctl:
        return 0
    from moe_lora.adapter_io import Adapter, export_merged, export_peft

    adapter = Adapter(tensors, config.lora.rank, config.lora.alpha, config.lora.use_rslora)
    if config.run.export == "peft":
        exported = export_peft(adapter, config.model.base, out_dir / "adapter", overwrite=True)
    else:
        # merged into the weights as trained (e.g. NF4-dequantized experts), not the stored ones
        exported = export_merged(
            adapter,
            config.model.base,
            out_dir / "merged",
            dtype="bf16",
            trained_plan=config.model.quant.plan(),
            overwrite=True,
        )
    plot = plot_run(log.records(), out_dir / "run.png")
    log.close()
    print(f"adapter: {exported}  metrics: {log.path}  plot: {plot}")
    print(f"{step} RL steps in {(time.time() - started) / 60:.1f} min")
    if base_greedy is not None:
        print(f"held-out greedy accuracy: base {100 * base_greedy:.1f}% -> trained {100 * greedy:.1f}%")
    print(f"held-out accuracy is {metric_name(config)} on {len(splits.heldout)} problems")
    if base_tools is not None:
        print(f"held-out tool-call rate: base {100 * base_tools:.1f}% -> trained {100 * tools:.1f}%")
    if ablation:
        print(
            f"memory ablation: own {100 * accuracy:.1f}%, "
            + ", ".join(f"{mode} {100 * share:.1f}%" for mode, share in ablation.items())
        )
    print(f"held-out accuracy: base {100 * base_accuracy:.1f}% -> trained {100 * accuracy:.1f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
