"""One RL worker: the frozen base loaded once, used by its rollout engine and its trainer.

All-sync (colocated): every worker generates its share of the batch, then every worker trains on it,
gradients of the replicated LoRA tensors are all-reduced (gloo/NCCL) so the replicas stay identical,
and the new adapter is synced to the engine. Strictly on-policy: every sample records the adapter
version that produced it, and training checks it equals the version being trained (staleness 0).

Expert parallelism (parallel.expert_parallel = k > 1, see moe_lora/expert_parallel.py): the worker loads
and trains only its block of E/k routed experts; their gradients are summed over its expert-data-parallel
group. Every MoE layer then exchanges tokens with the other ranks of its EP group, so the ranks run every
forward and backward in lockstep: a rank with nothing of its own still takes part, on one masked-out row
(`idle_batch`), in generation rounds (`_serve_generation_rounds`) and through the torch engine.

The class is plain Python; the recipe wraps it in a Ray actor (one per device), runs it in-process, or runs one per
process under torchrun / accelerate launch (allsync/launch/).
"""

from __future__ import annotations

import time
from dataclasses import asdict
from pathlib import Path

import torch

from allsync.config import RunConfig, import_extensions
from allsync.episodes import Episode, episode_info_sums, stale_versions
from allsync.engines.torch_engine import TorchEngine
from allsync.health.faults import FaultInjector, parse_faults
from allsync.health.monitor import WorkerMonitor
from allsync.distributed.devices import keep_freed_host_memory, worker_device
from allsync.distributed.process_groups import Groups, connect
from allsync.producers.registry import ProducerContext
from allsync.run.checkpoint import write_probe
from allsync.run.engine_link import (
    build_engine,
    dtype_of,
    engine_tensors,
    keep_compute_copies_within,
    lora_config,
    sync_adapter,
    take_counters,
    engine_context,
)
from allsync.run.evaluation import RewardError, heldout_records  # noqa: F401 - RewardError is part of the worker's API
from allsync.run.footprint import expert_memory, loaded_bytes
from allsync.run.problem_stream import ProblemStream
from allsync.run.randomness import own_random_stream, seed_everything
from allsync.run.scoring import Scorer
from allsync.run.sharded_state import ShardedTrainingState
from allsync.tasks import Problem, encode_prompt
from allsync.update.learner import Learner
from allsync.update.policy_state import PolicyState
from moe_lora.expert_parallel import ExpertLayout, shard_experts
from moe_lora.lora import attach_lora, load_lora_state_dict, seeded_init_
from quant.checkpoint_io import read_config
from quant.loader import load_frozen_model

EVAL_SEED = 10**6  # evaluations draw from seed EVAL_SEED + run.seed * 1000 + rank, apart from training's


def load_trainable_base(config: RunConfig, rank: int, layout: ExpertLayout | None, device: torch.device):
    """The frozen base in model.quant's formats (only this rank's block of routed experts under expert parallelism),
    with the LoRA of config.lora attached and drawn from run.seed (the same adapter on every rank and under every
    expert layout), and its dequantized compute copies when model.compute_copy."""
    dtype = dtype_of(config.model.compute_dtype)
    experts = layout.experts_of(rank) if layout is not None else None
    model = load_frozen_model(
        config.model.base,
        config.model.quant.plan(),
        compute_dtype=dtype,
        progress=rank == 0,
        experts=experts,
        device=device,
    )
    attach_lora(model, lora_config(config))
    seeded_init_(model, config.run.seed)
    if config.model.compute_copy:
        keep_compute_copies_within(model, dtype, device)
    return model


def rollout_metrics(
    episodes: list[Episode], generated: list[Episode], counts: dict, version: int, reward_errors: int
) -> dict:
    """A rollout's sums and counts over every episode `generated` (those dynamic sampling dropped too), the staleness
    of the kept `episodes` against `version`, and the producer's own `counts`."""
    return {
        "samples_generated": len(generated),
        "reward_sum": sum(e.reward for e in generated),
        "correct_sum": sum(e.correct for e in generated),
        "response_tokens": sum(len(e.final.response_ids) for e in generated),
        "truncated": sum(e.final.finish_reason == "length" for e in generated),
        "staleness_max": max((version - s.adapter_version for e in episodes for s in e.segments), default=0),
        "continuing": 0,
        "reward_errors": reward_errors,
        **counts,  # the producer's counts (dynamic sampling's; T-PPO's staleness and continuing responses)
    }


def worker_groups(config: RunConfig, rank: int, world_size: int, dist_address: str | None, launcher: bool):
    """(the ExpertLayout or None, allsync.distributed.process_groups.Groups): joined with the other workers' through a
    TCP store at `dist_address` or the launcher's environment; a group of one otherwise (a generator of the
    disaggregated layout, an in-process worker)."""
    k, per_node = config.parallel.expert_parallel, config.parallel.workers_per_node
    experts_total = read_config(config.model.base)["n_routed_experts"]
    layout = ExpertLayout(world_size, k, experts_total, per_node) if k > 1 else None
    groups = Groups(rank, 1, layout)
    if world_size > 1 and (dist_address is not None or launcher):
        groups = connect(rank, world_size, dist_address, config.parallel.resolved_backend(), layout)
    groups.engine_lockstep = config.rollout.engine_expert_parallel  # one vLLM engine over the workers
    return layout, groups


def shard_routed_experts(model, groups, layout, rank: int):
    """Under expert parallelism, the MoE layers set to exchange tokens with the EP group (moe_lora.expert_parallel)
    and what this rank loaded printed; returns the dispatch counters (what its all-to-alls move), or None."""
    if layout is None:
        return None
    held = layout.experts_of(rank)
    stats = shard_experts(model, groups.ep, layout, rank, groups.node, groups.rail)
    print(
        f"rank {rank}: routed experts {held.start}-{held.stop - 1} of {layout.num_experts}; read "
        f"{model.checkpoint_bytes_read:,} checkpoint bytes ({model.checkpoint_expert_bytes_read:,} of them experts')"
    )
    return stats


class RLWorker:
    def __init__(
        self,
        config: RunConfig,
        problems: list[Problem],
        rank: int = 0,
        world_size: int = 1,
        dist_address: str | None = None,
        threads: int | None = None,
        max_model_len: int | None = None,
        launcher: bool = False,
        attempt: int = 0,
    ):
        """rank / world_size: this worker's place among the workers that share the data (prompts are strided
        over them). dist_address: join the process groups of `world_size` workers (allsync.distributed.process_groups) through
        a TCP store there; None for a worker that only generates (the disaggregated baseline's generators).
        launcher: SPMD, started by torchrun / accelerate launch: the groups come from the environment.
        max_model_len: the vLLM engine's context (longest prompt + rollout.max_new_tokens, see
        allsync.tasks.model_len_needed); None computes it from `problems`. attempt: 0 for a run's first start, n
        after its n-th restart (fault drills, allsync/health/faults.py, fire only in the first)."""
        import_extensions(config.run.imports)  # a worker process registers the run's own extensions too
        self.config, self.rank, self.world_size, self.launcher = config, rank, world_size, launcher
        if threads:
            torch.set_num_threads(threads)
        self.device = worker_device(config.parallel.resolved_device(), launcher)
        if self.device.type == "cpu":  # activations live in host memory: reuse it (10% of the default step)
            keep_freed_host_memory(config.parallel.workers_per_node)
        self.layout, self.groups = worker_groups(config, rank, world_size, dist_address, launcher)
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(config.model.base)
        self.model = load_trainable_base(config, rank, self.layout, self.device)
        self.dispatch_stats = shard_routed_experts(self.model, self.groups, self.layout, rank)
        self.monitor = WorkerMonitor(self.device)
        self.timeline = self.monitor.timeline
        self.faults = FaultInjector(parse_faults(config.health.faults, world_size), rank, enabled=attempt == 0)
        self.policy = PolicyState(self.model, config, self.groups, self.layout, self.device)  # the one policy held
        m, g, pad, drill = self.model, self.groups, self.tokenizer.pad_token_id, self.faults.before_gradient_reduce
        self.learner = Learner(m, config, g, self.layout, self.device, pad, self.timeline, rank, drill)
        self.state = ShardedTrainingState(self.model, self.policy, self.groups, self.layout, rank, config)
        # seeded after building: how many numbers attach_lora drew depends on the experts this rank holds
        seed_everything(config.run.seed * 1000 + rank)
        self.data = ProblemStream(problems, rank, world_size, self.tokenizer)
        self.scorer = Scorer(config, self.tokenizer, rank, self.monitor)  # the reward processes and shaping
        self.max_model_len = max_model_len
        self.engine = self._make_engine()
        self.producer = self._make_producer()

    def _make_producer(self):
        """The episode producer producer.kind names (allsync/producers/), given this worker's engine and data."""
        c, d = self.config, self.data
        per_worker = c.rollout.prompts_per_step // self.world_size * c.rollout.group_size
        context = ProducerContext(
            c,
            self.engine,
            self.tokenizer,
            self.encode_prompt,
            d.take_problems,
            self.scorer.score_episodes,
            per_worker,
            self.groups,
            d.rewind_point,
            d.longest_prompt,
        )
        return c.producer.build(context)

    def _make_engine(self):
        """The engine rollout.engine names (allsync/run/engine_link.py); a vLLM engine of context max_model_len (None:
        what the producer needs for `problems`) gets this rank's adapter, version 0, before it generates."""
        model_len = engine_context(self.config, self.tokenizer, self.data.problems, self.model, self.max_model_len)
        engine = build_engine(
            self.config, self.model, self.tokenizer, self.device, self.groups, self.launcher, model_len
        )
        if not isinstance(engine, TorchEngine):
            moved, _ = self.sync_engine(engine, 0)
            if self.rank == 0:
                print(
                    f"vLLM engine: adapter-only sync, {moved:,} bytes of LoRA tensors per update, max_model_len "
                    f"{model_len}"
                )
        return engine

    def encode_prompt(self, problem: Problem) -> list[int]:
        return encode_prompt(self.tokenizer, problem)

    # ------------------------------------------------------------------------------ the step
    def step(self, step_index: int) -> dict:
        """One all-sync (colocated) step: generate this worker's share, train on it with every worker, sync.
        Returns sums/counts that the controller aggregates over workers."""
        wall0 = time.time()
        self.faults.begin_step(step_index)
        episodes, group_index, metrics = self.rollout_phase(self.config.rollout.prompts_per_step // self.world_size)
        metrics.update(self.train_phase(episodes, group_index))
        self.producer.trained(self.policy.version)
        t = time.time()
        metrics["sync_bytes"], gap = self.sync_engine(self.engine, self.policy.version)
        if gap is not None:  # the version's SHA-256 as sent and as the engine received it (equal: checked)
            metrics.update(sync_probe_gap=gap, sync_sha256=self.engine.sent_checksum[:16])
        self.timeline.record("sync", t)
        metrics.update(self.busy_report(wall0))
        if self.dispatch_stats is not None:  # expert parallelism: what this rank's all-to-alls moved this step
            metrics.update(self.dispatch_stats.take())
        work = self.take_engine_counters()
        positions = work.pop("positions")
        metrics.update(work)  # the torch engine's decode slots and the tokens they produced (metrics.aggregate)
        if positions:  # the engine's positions computed (metrics.aggregate: per trained token)
            metrics["engine_positions"] = positions
        metrics.update(self.monitor.report(metrics, positions))
        return metrics

    def sync_engine(self, engine, version: int) -> tuple[int, float | None]:
        """The adapter of `version` into the engine, checked (allsync/run/engine_link.py sync_adapter); returns
        (bytes moved, the sync probe's gap or None)."""
        tensors = None if isinstance(engine, TorchEngine) else self.engine_adapter_tensors(engine)
        tolerance = self.config.rollout.sync_tolerance
        return sync_adapter(engine, tensors, version, self.model, self.tokenizer, tolerance)

    def take_engine_counters(self) -> dict[str, int]:
        """The engine's work counters since the last call, reset to 0 (engine_link.take_counters)."""
        return take_counters(self.engine)

    def rollout_phase(self, groups_wanted: int) -> tuple[list[Episode], torch.Tensor, dict]:
        """The producer's episodes from the current adapter, scored (DAPO: mixed groups kept); timed as "generate"."""
        t = time.time()
        self.faults.during_generate()
        episodes, group_index, ds = self.producer.collect(groups_wanted, self.policy.version)
        self.engine.release_memory()  # vLLM on GPUs: its KV cache's memory goes to the trainer
        self.faults.after_generate(time.time() - t)
        self.timeline.record("generate", t)
        generated = ds.pop("generated")
        metrics = rollout_metrics(episodes, generated, ds, self.policy.version, self.scorer.take_errors())
        if self.config.producer.logs_episode_info:  # segments, memory tokens, turns, ...
            metrics.update(episode_info_sums(generated))
        return episodes, group_index, metrics

    def train_phase(self, episodes: list[Episode], group_index: torch.Tensor) -> dict:
        """Strictly on-policy update: every segment must come from the adapter being trained (staleness 0);
        timed as "train". The adapter version advances by one."""
        t = time.time()
        stale = stale_versions(episodes, self.policy.version)
        if stale:
            raise RuntimeError(
                f"worker {self.rank}: samples from adapter version {stale[0]} while training {self.policy.version}"
            )
        metrics = self.learner.train(self.policy, episodes, group_index)
        self.policy.version += 1
        self.timeline.record("train", t)
        return metrics

    def train(self, episodes: list[Episode], group_index: torch.Tensor) -> dict:
        """The update of this worker's policy on `episodes`, without train_phase's staleness check, timing and version
        step: drives the learner from the controller side (tests, benchmarks) over any launch mode."""
        return self.learner.train(self.policy, episodes, group_index)

    def receive_adapter(self, tensors: dict[str, torch.Tensor], version: int) -> int:
        """Load LoRA tensors trained elsewhere (a generator of the disaggregated layout); returns bytes received."""
        t = time.time()
        load_lora_state_dict(self.model, tensors)
        self.policy.version = version
        self.sync_engine(self.engine, version)
        self.timeline.record("sync", t)
        return sum(v.numel() * v.element_size() for v in tensors.values())

    def busy_report(self, since: float) -> dict:
        """Wall time since `since` (the step's start) and busy time since the last report (once per step)."""
        return {"wall_seconds": time.time() - since, "busy_seconds": self.timeline.busy_since_last_report()}

    # ------------------------------------------------------------------------------ evaluation
    @torch.no_grad()
    def evaluate(self, problems: list[Problem], samples: int = 1, memory: str = "own") -> list[dict]:
        """Greedy (samples=1) or temperature-sampled responses to this worker's share of `problems`, scored:
        evals.report.SampleRecord fields per response, problem_id the index in `problems`. Multi-conversation
        episodes are run whole and their answers scored; `memory` blank / gold answers from an empty or the
        task's gold memory instead of the episode's own (the memory ablation)."""
        work = self.take_engine_counters()
        try:
            with own_random_stream(EVAL_SEED + self.config.run.seed * 1000 + self.rank, self.device):
                ids = list(range(self.rank, len(problems), self.world_size))
                if not ids and not self.groups.lockstep:  # the engine keeps this rank in lockstep
                    return []
                p, t, pool, c = self.producer, self.tokenizer, self.scorer.pool, self.config
                records = heldout_records(p, t, pool, c, problems, ids, samples, memory, f" of worker {self.rank}")
                return [asdict(r) for r in records]
        finally:  # evaluation's work is not the next step's: its health signals divide the step's work by its time
            for name, count in work.items():
                setattr(self.engine, name, count)
            if self.dispatch_stats is not None:  # evaluation runs between steps, after the step took its totals
                self.dispatch_stats.take()

    # ------------------------------------------------------------------------------ checkpoints
    def adapter_tensors(self) -> dict[str, torch.Tensor]:
        """This rank's adapter tensors under PEFT names (its expert block only, under expert parallelism)."""
        return self.state.adapter_tensors()

    def engine_adapter_tensors(self, engine) -> dict[str, torch.Tensor]:
        """The adapter tensors `engine` serves on this rank (engine_link.engine_tensors)."""
        return engine_tensors(engine, self.adapter_tensors(), self.rank, self.world_size, self.layout, self.groups)

    def full_adapter_tensors(self) -> dict[str, torch.Tensor] | None:
        """The whole adapter on rank 0 (None on the others), in CPU memory: the controller exports it, and under
        Ray it leaves this process. Under expert parallelism every rank of the first EP group must call it."""
        return self.state.full_adapter_tensors()

    def gradient_tensors(self) -> list[torch.Tensor]:
        """The LoRA gradients of the last minibatch, after the all-reduce (what every rank applied)."""
        return [p.grad.detach().clone() for p in self.policy.optimized]

    def parameter_tensors(self) -> list[torch.Tensor]:
        """The trained tensors in `gradient_tensors`' order (entry i of one is entry i of the other)."""
        return [p.detach().clone() for p in self.policy.optimized]

    def write_probe(self, directory: str) -> str:
        """A file of this rank's in `directory` (the controller checks that it sees every rank's: checkpoint parts
        are written the same way); returns this host's name."""
        return write_probe(Path(directory), self.rank)

    def save_state(self, directory: str) -> None:
        """This worker's part of a checkpoint (allsync/run/sharded_state.py): the policy from rank 0; RNG states,
        data position and T-PPO pools from every rank."""
        self.state.save(directory, {"position": self.data.position, **self.producer.state_dict()})

    def load_state(self, directory: str) -> None:
        mine = self.state.load(directory)
        self.sync_engine(self.engine, self.policy.version)
        self.data.position = mine["position"]
        self.producer.load_state_dict(mine)

    def loaded_bytes(self) -> dict:
        """Checkpoint bytes this rank read at load (all, routed experts' share) and the experts it holds."""
        return loaded_bytes(self.model, self.layout, self.rank)

    def expert_memory(self) -> dict:
        """Resident bytes of this rank's routed experts: frozen weights, their LoRA tensors and AdamW's state."""
        return expert_memory(self.model, self.policy.optimizer)

    def timeline_events(self) -> list[tuple[str, float, float]]:
        return list(self.timeline.events)

    def shutdown(self) -> None:
        self.groups = self.learner.groups = self.state.groups = Groups(self.rank, 1, self.layout)
        self.faults.close()
        self.scorer.close()
        self.producer.close()
        if hasattr(self.engine, "close"):
            self.engine.close()
