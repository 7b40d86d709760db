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

import contextlib
import random
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch

from allsync.checkpoint import write_probe
from allsync.scoring import Scorer
from allsync.config import ConfigError, RunConfig, import_extensions
from allsync.launch.devices import keep_freed_host_memory, worker_device
from allsync.launch.process_groups import Groups, connect
from allsync.episodes import Episode, episode_info_sums, stale_versions
from allsync.evaluation import RewardError, heldout_records  # noqa: F401 - RewardError is part of the worker's API
from allsync.health.faults import FaultInjector, parse_faults
from allsync.health.monitor import WorkerMonitor
from allsync.producers.registry import ProducerContext
from allsync.engines.engine_experts import exchange_engine_blocks
from allsync.engines.sync_check import check_sync, effect_gap, probe_ids
from allsync.engines.torch_engine import TorchEngine
from allsync.forward import build_sequences, forward_logprobs
from allsync.sharded_state import ShardedTrainingState
from allsync.tasks import Problem, encode_prompt, longest_prompt_tokens
from allsync.learner import Learner
from moe_lora.expert_parallel import ExpertLayout, shard_experts
from moe_lora.lora import LoRAConfig, LoRAExperts, adapters_disabled, attach_lora, load_lora_state_dict, seeded_init_
from quant.checkpoint_io import read_config
from quant.loader import load_frozen_model
from quant.modules import compute_copy_bytes, keep_compute_copies

EVAL_SEED = 10**6  # evaluations draw from seed EVAL_SEED + run.seed * 1000 + rank, apart from training's


def free_device_bytes(device: torch.device) -> int:
    """Memory free for new tensors on `device`: the GPU's free memory, or the host's available memory."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    import psutil

    return psutil.virtual_memory().available


def keep_compute_copies_within(model, dtype: torch.dtype, device: torch.device) -> int:
    """model.compute_copy: the dequantized copies (quant.modules.keep_compute_copies), refused before they are
    made when they would take more than half of `device`'s free memory."""
    need, free = compute_copy_bytes(model, dtype), free_device_bytes(device)
    if need > free / 2:
        raise ConfigError(
            f"model.compute_copy: a {dtype} copy of the frozen weights needs {need / 2**30:.1f} GiB, more than "
            f"half of the {free / 2**30:.1f} GiB free on {device}; set model.compute_copy: false"
        )
    return keep_compute_copies(model, dtype)


def lora_config(config: RunConfig) -> LoRAConfig:
    """The lora section as moe_lora.lora's LoRAConfig."""
    lc = config.lora
    return LoRAConfig(
        lc.rank,
        lc.alpha,
        tuple(lc.targets),
        lc.dropout,
        lc.use_rslora,
        expert_kernel=lc.expert_kernel,
        expert_layout=lc.expert_layout,
    )


def tie_lora(copy: torch.nn.Module, model: torch.nn.Module) -> int:
    """Make every trainable parameter of `copy` (a second frozen model with the same LoRA attached) the same
    Parameter object as `model`'s of that name; returns how many were tied."""
    theirs = {name: p for name, p in model.named_parameters() if p.requires_grad}
    mine = [name for name, p in copy.named_parameters() if p.requires_grad]
    if sorted(mine) != sorted(theirs):
        raise ValueError("rollout.engine_formats: the engine's copy has other LoRA parameters than the trainer's")
    for name in mine:
        parent, _, leaf = name.rpartition(".")
        setattr(copy.get_submodule(parent), leaf, theirs[name])
    return len(mine)


class NaNLossError(RuntimeError):
    """Too many consecutive steps with a non-finite loss."""


def _dtype(name: str) -> torch.dtype:
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[name]


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
        over them). dist_address: join the process groups of `world_size` workers (allsync.launch.process_groups) through
        a TCP store there; None for a worker that only generates (the disaggregated baseline's generators).
        launcher: SPMD, started by torchrun / accelerate launch: the groups come from the environment.
        max_model_len: the vLLM engine's context (longest prompt + rollout.max_new_tokens, see
        allsync.tasks.model_len_needed); None computes it from `problems`. attempt: 0 for a run's first start, n
        after its n-th restart (fault drills, allsync/health/faults.py, fire only in the first)."""
        import_extensions(config.run.imports)  # a worker process registers the run's own extensions too
        self.config, self.rank, self.world_size, self.launcher = config, rank, world_size, launcher
        if threads:
            torch.set_num_threads(threads)
        base = config.model.base
        self.device = worker_device(config.parallel.resolved_device(), launcher)
        if self.device.type == "cpu":  # activations live in host memory: reuse it (10% of the default step)
            keep_freed_host_memory(config.parallel.workers_per_node)
        k = config.parallel.expert_parallel
        experts_total, per_node = read_config(base)["n_routed_experts"], config.parallel.workers_per_node
        self.layout = ExpertLayout(world_size, k, experts_total, per_node) if k > 1 else None
        self.groups = Groups(rank, 1, self.layout)
        if world_size > 1 and (dist_address is not None or launcher):
            self.groups = connect(rank, world_size, dist_address, config.parallel.resolved_backend(), self.layout)
        self.groups.engine_lockstep = config.rollout.engine_expert_parallel  # one vLLM engine over the workers
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(base)
        experts = self.layout.experts_of(rank) if self.layout is not None else None
        self.model = load_frozen_model(
            base,
            config.model.quant.plan(),
            compute_dtype=_dtype(config.model.compute_dtype),
            progress=rank == 0,
            experts=experts,
            device=self.device,
        )
        attach_lora(self.model, lora_config(config))
        seeded_init_(self.model, config.run.seed)  # the same adapter on every rank and under every expert layout
        if config.model.compute_copy:
            keep_compute_copies_within(self.model, _dtype(config.model.compute_dtype), self.device)
        self.dispatch_stats = (
            shard_experts(self.model, self.groups.ep, self.layout, rank, self.groups.node, self.groups.rail)
            if self.layout is not None
            else None
        )
        if self.layout is not None:
            held, m = self.layout.experts_of(rank), self.model
            print(
                f"rank {rank}: routed experts {held.start}-{held.stop - 1} of {self.layout.num_experts}; read "
                f"{m.checkpoint_bytes_read:,} checkpoint bytes ({m.checkpoint_expert_bytes_read:,} of them experts')"
            )
        self.monitor = WorkerMonitor(self.device)
        self.timeline = self.monitor.timeline
        self.faults = FaultInjector(parse_faults(config.health.faults, world_size), rank, enabled=attempt == 0)
        self.learner = Learner(
            self.model,
            config,
            self.groups,
            self.layout,
            self.device,
            self.tokenizer.pad_token_id,
            self.timeline,
            rank,
            before_gradient_reduce=self.faults.before_gradient_reduce,
        )
        self.state = ShardedTrainingState(self.model, self.learner, self.layout, rank, config)
        # seeded after building: how many numbers attach_lora drew depends on the experts this rank holds
        self._seed_everything(config.run.seed * 1000 + rank)
        self.problems = problems
        self.scorer = Scorer(config, self.tokenizer, rank, self.monitor)  # the reward processes and shaping
        self.max_model_len = max_model_len
        self.engine = self._make_engine()
        self.adapter_version = 0
        self.position = 0  # prompts taken so far by this worker (data position)
        self.producer = self._make_producer()

    @property
    def critic(self):
        return self.learner.critic

    def _make_producer(self):
        """The episode producer producer.kind names (allsync/producers/), given this worker's engine and data."""
        c = self.config
        context = ProducerContext(
            c,
            self.engine,
            self.tokenizer,
            self.encode_prompt,
            self.take_problems,
            self.scorer.score_episodes,
            c.rollout.prompts_per_step // self.world_size * c.rollout.group_size,
            self.groups,
            self.rewind_point,
            self.longest_prompt,
        )
        return c.producer.build(context)

    # ------------------------------------------------------------------------------ helpers
    def _make_engine(self):
        """torch: generate with the training model itself. vllm: a vLLM engine in this process on the same
        checkpoint, given the LoRA tensors after every update (adapter-only sync)."""
        if self.config.rollout.engine == "torch":
            lockstep = self.groups if self.groups.expert_parallel else None
            r = self.config.rollout
            return TorchEngine(
                self.model if r.engine_formats is None else self.engine_copy(),
                self.tokenizer.eos_token_id,
                self.tokenizer.pad_token_id,
                r.decode_batch,
                lockstep=lockstep,
                merge_lora=r.merge_lora,
                decode_graphs=r.decode_graphs,
                kv_cache_dtype=r.kv_cache_dtype,
                attention_kernel=r.attention_kernel,
                kv_cache_tokens=r.kv_cache_tokens,
                frozen_expert_kernel=r.frozen_expert_kernel,
                fp8_linear_kernel=r.fp8_linear_kernel,
            )
        from allsync.engines.vllm_engine import VLLMEngine  # refuses what this machine's vLLM cannot run

        lc, r = self.config.lora, self.config.rollout
        model_len = self.max_model_len or self.config.producer.model_len(
            self.config, self.tokenizer, self.problems, self.model.config.max_position_embeddings
        )
        model_len = max(model_len, len(probe_ids(self.tokenizer)[0]) + 1)  # the sync probe is scored in it too
        engine = VLLMEngine(
            self.config.model.base,
            lc.rank,
            lc.alpha,
            lc.use_rslora,
            dtype=self.config.model.compute_dtype,
            max_model_len=model_len,
            launcher=self.launcher,
            gpu_memory_utilization=r.gpu_memory_utilization,
            tensor_parallel=r.engine_tensor_parallel,
            lockstep=self.groups if r.engine_expert_parallel else None,
            lora_targets=lc.targets,
        )
        moved, _ = self.sync_engine(engine, 0)
        if self.rank == 0:
            print(
                f"vLLM engine: adapter-only sync, {moved:,} bytes of LoRA tensors per update, max_model_len {model_len}"
            )
        return engine

    def engine_copy(self):
        """rollout.engine_formats: a second frozen model in those formats (the rest as model.quant) whose LoRA
        tensors are the trainer's own parameters (`tie_lora`), so every update reaches it with nothing to copy."""
        c = self.config
        dtype = _dtype(c.model.compute_dtype)
        plan = c.model.quant.plan(c.rollout.engine_formats)
        model = load_frozen_model(c.model.base, plan, compute_dtype=dtype, progress=False, device=self.device)
        with torch.random.fork_rng(devices=[]):  # its own initial factors are replaced: draw nothing from the run's RNG
            attach_lora(model, lora_config(c))
        tie_lora(model, self.model)
        if c.model.compute_copy:
            keep_compute_copies_within(model, dtype, self.device)
        return model

    @staticmethod
    def _seed_everything(seed: int) -> None:
        random.seed(seed)
        np.random.seed(seed % 2**32)
        torch.manual_seed(seed)

    @contextlib.contextmanager
    def own_random_stream(self, seed: int):
        """Draws inside come from `seed` (python, numpy, torch on this worker's devices), and the run's generators
        are as they were afterwards: what runs inside (an evaluation) never moves the training samples, so a run
        stopped with --steps N (evaluated at N) and resumed samples what a run that never stopped samples."""
        python, numpy = random.getstate(), np.random.get_state()
        devices = [self.device.index] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            self._seed_everything(seed)
            try:
                yield
            finally:
                random.setstate(python)
                np.random.set_state(numpy)

    def encode_prompt(self, problem: Problem) -> list[int]:
        return encode_prompt(self.tokenizer, problem)

    def rewind_point(self):
        """A function that puts take_problems' position and torch's generator back where they are now."""
        position, generator = self.position, torch.get_rng_state()

        def rewind() -> None:
            self.position = position
            torch.set_rng_state(generator)

        return rewind

    def longest_prompt(self) -> int:
        """The most prompt tokens of any training problem (what a streamed call's KV slots must hold besides the
        response), counted once."""
        if getattr(self, "_longest_prompt", None) is None:
            self._longest_prompt = longest_prompt_tokens(self.tokenizer, self.problems)
        return self._longest_prompt

    def take_problems(self, count: int) -> list[Problem]:
        """The next `count` training problems of this worker's stride through the shared train split."""
        n = len(self.problems)
        picked = [self.problems[((self.position + i) * self.world_size + self.rank) % n] for i in range(count)]
        self.position += count
        return picked

    # ------------------------------------------------------------------------------ the step
    def step(self, step_index: int) -> dict:
        """One all-sync (colocated) step: generate this worker's share, train on it with every worker, sync.
        Returns sums/counts that the controller aggregates over workers."""
        wall0 = time.time()
        self.faults.begin_step(step_index)
        episodes, group_index, metrics = self.rollout_phase(self.config.rollout.prompts_per_step // self.world_size)
        metrics.update(self.train_phase(episodes, group_index))
        self.producer.trained(self.adapter_version)
        t = time.time()
        metrics["sync_bytes"], gap = self.sync_engine(self.engine, self.adapter_version)
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
        """The adapter of `version` into the engine; returns (bytes moved, the sync probe's gap or None). The torch
        engine's LoRA tensors are the trainer's own (nothing moves, nothing to check); an engine with its own copy
        (vLLM) gets this rank's tensors and must show it runs them (allsync/engines/sync_check.py), or the run stops
        with AdapterSyncError naming the version."""
        if isinstance(engine, TorchEngine):
            return engine.load_adapter(None, version), None
        moved = engine.load_adapter(self.engine_adapter_tensors(engine), version)
        ids, start = probe_ids(self.tokenizer)
        batch = build_sequences([ids[:start]], [ids[start:]], self.learner.pad_id).to(self.device)
        scored = batch.response_mask > 0
        with torch.no_grad():
            trainer_with = forward_logprobs(self.model, batch)[scored]
            with adapters_disabled(self.model):
                trainer_without = forward_logprobs(self.model, batch)[scored]
        gap, effect, mismatch = effect_gap(
            engine.score(ids, start), engine.score(ids, start, False), trainer_with, trainer_without
        )
        tolerance = self.config.rollout.sync_tolerance
        check_sync(version, engine.sent_checksum, engine.received_checksums, gap, effect, mismatch, tolerance)
        return moved, gap

    def take_engine_counters(self) -> dict[str, int]:
        """The engine's work counters (`engine.counters`: token positions; decode slots and the tokens they produced)
        since the last call, reset to 0."""
        work = {name: getattr(self.engine, name) for name in self.engine.counters}
        for name in work:
            setattr(self.engine, name, 0)
        return work

    def rollout_phase(self, groups_wanted: int) -> tuple[list[Episode], torch.Tensor, dict]:
        """The producer's episodes from the current adapter, scored (DAPO: mixed groups kept); timed as "generate"."""
        t = time.time()
        self.faults.during_generate()
        episodes, group_index, ds = self.producer.collect(groups_wanted, self.adapter_version)
        self.engine.release_memory()  # vLLM on GPUs: its KV cache's memory goes to the trainer
        self.faults.after_generate(time.time() - t)
        self.timeline.record("generate", t)
        generated = ds.pop("generated")
        errors = self.scorer.take_errors()
        metrics = {
            "samples_generated": len(generated),
            "reward_sum": sum(e.reward for e in generated),
            "correct_sum": sum(e.correct for e in generated),
            "response_tokens": sum(len(e.final.response_ids) for e in generated),
            "truncated": sum(e.final.finish_reason == "length" for e in generated),
            "staleness_max": max(
                (self.adapter_version - v for e in episodes for v in (s.adapter_version for s in e.segments)), default=0
            ),
            "continuing": 0,
            "reward_errors": errors,
            **ds,  # the producer's counts (dynamic sampling's; T-PPO's staleness and continuing responses)
        }
        if self.config.producer.logs_episode_info:  # segments, memory tokens, turns, ...
            metrics.update(episode_info_sums(generated))
        return episodes, group_index, metrics

    def train_phase(self, episodes: list[Episode], group_index: torch.Tensor) -> dict:
        """Strictly on-policy update: every segment must come from the adapter being trained (staleness 0);
        timed as "train". The adapter version advances by one."""
        t = time.time()
        stale = stale_versions(episodes, self.adapter_version)
        if stale:
            raise RuntimeError(
                f"worker {self.rank}: samples from adapter version {stale[0]} while training {self.adapter_version}"
            )
        metrics = self.train(episodes, group_index)
        self.adapter_version += 1
        self.timeline.record("train", t)
        return metrics

    def train(self, episodes: list[Episode], group_index: torch.Tensor) -> dict:
        return self.learner.train(episodes, group_index, self.adapter_version)

    def receive_adapter(self, tensors: dict[str, torch.Tensor], version: int) -> int:
        """Load LoRA tensors trained elsewhere (a generator of the disaggregated layout); returns bytes received."""
        t = time.time()
        load_lora_state_dict(self.model, tensors)
        self.adapter_version = version
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
            with self.own_random_stream(EVAL_SEED + self.config.run.seed * 1000 + self.rank):
                return self._evaluate(problems, samples, memory)
        finally:  # evaluation's work is not the next step's: its health signals divide the step's work by its time
            for name, count in work.items():
                setattr(self.engine, name, count)
            if self.dispatch_stats is not None:  # evaluation runs between steps, after the step took its totals
                self.dispatch_stats.take()

    def _evaluate(self, problems: list[Problem], samples: int, memory: str) -> list[dict]:
        ids = list(range(self.rank, len(problems), self.world_size))
        if not ids and not self.groups.lockstep:  # the engine keeps this rank in lockstep
            return []
        records = heldout_records(
            self.producer,
            self.tokenizer,
            self.scorer.pool,
            self.config,
            problems,
            ids,
            samples,
            memory,
            where=f" of worker {self.rank}",
        )
        return [asdict(r) for r in records]

    # ------------------------------------------------------------------------------ checkpoints
    def adapter_tensors(self) -> dict[str, torch.Tensor]:
        """This rank's adapter tensors under PEFT names (its expert block only, under expert parallelism)."""
        return self.state.adapter_tensors()

    def engine_adapter_tensors(self, engine) -> dict[str, torch.Tensor]:
        """The adapter tensors `engine` serves on this rank: this rank's own, or with the engine's experts sharded over
        every worker (rollout.engine_expert_parallel) those outside the routed experts and the LoRA of the engine's
        block of experts, from the rank that trains them (allsync/engines/engine_experts.py)."""
        if engine.experts is None:
            return self.adapter_tensors()
        k, g = self.layout.ep_size if self.layout is not None else 1, self.groups
        tensors = self.adapter_tensors()
        return exchange_engine_blocks(tensors, self.rank, self.world_size, k, engine.num_experts, g.world, g.device)

    def full_adapter_tensors(self) -> dict[str, torch.Tensor] | None:
        """The whole adapter on rank 0 (None on the others), in CPU memory: the controller exports it, and under
        Ray it leaves this process. Under expert parallelism every rank of the first EP group must call it."""
        return self.state.full_adapter_tensors()

    def gradient_tensors(self) -> list[torch.Tensor]:
        """The LoRA gradients of the last minibatch, after the all-reduce (what every rank applied)."""
        return [p.grad.detach().clone() for p in self.learner.optimized]

    def parameter_tensors(self) -> list[torch.Tensor]:
        """The trained tensors in `gradient_tensors`' order (entry i of one is entry i of the other)."""
        return [p.detach().clone() for p in self.learner.optimized]

    def write_probe(self, directory: str) -> str:
        """A file of this rank's in `directory` (the controller checks that it sees every rank's: checkpoint parts
        are written the same way); returns this host's name."""
        return write_probe(Path(directory), self.rank)

    def save_state(self, directory: str) -> None:
        """This worker's part of a checkpoint (allsync/sharded_state.py): the whole adapter, AdamW state and value
        head from rank 0; RNG states, data position and T-PPO pools from every rank."""
        self.state.save(
            directory,
            self.adapter_version,
            {"position": self.position, "consecutive_nan": self.learner.consecutive_nan, **self.producer.state_dict()},
        )

    def load_state(self, directory: str) -> None:
        self.adapter_version, mine = self.state.load(directory)
        self.sync_engine(self.engine, self.adapter_version)
        self.position, self.learner.consecutive_nan = mine["position"], mine["consecutive_nan"]
        self.producer.load_state_dict(mine)

    def loaded_bytes(self) -> dict:
        """Checkpoint bytes this rank read at load (all, routed experts' share) and the experts it holds."""
        held = (
            self.layout.experts_of(self.rank) if self.layout is not None else range(self.model.config.n_routed_experts)
        )
        return {
            "bytes": self.model.checkpoint_bytes_read,
            "expert_bytes": self.model.checkpoint_expert_bytes_read,
            "experts": [held.start, held.stop],
        }

    def expert_memory(self) -> dict:
        """Resident bytes of this rank's routed experts: frozen weights, their LoRA tensors, and AdamW's state
        for those tensors (allocated when the learner is built: allsync.learner.allocate_adamw_state)."""
        from quant.modules import FrozenExperts

        frozen = sum(
            w.nbytes
            for m in self.model.modules()
            if isinstance(m, FrozenExperts)
            for ws in m.weights.values()
            for w in ws
        )
        adapters = [p for m in self.model.modules() if isinstance(m, LoRAExperts) for p in m.adapter_parameters()]
        state = [
            t
            for p in adapters
            for t in self.learner.optimizer.state.get(p, {}).values()
            if isinstance(t, torch.Tensor) and t.dim() > 0
        ]
        nbytes = lambda ts: sum(t.numel() * t.element_size() for t in ts)  # noqa: E731
        return {"frozen": frozen, "adapters": nbytes(adapters), "optimizer": nbytes(state)}

    def timeline_events(self) -> list[tuple[str, float, float]]:
        return list(self.timeline.events)

    def shutdown(self) -> None:
        self.groups = self.learner.groups = Groups(self.rank, 1, self.layout)
        self.faults.close()
        self.scorer.close()
        self.producer.close()
        if hasattr(self.engine, "close"):
            self.engine.close()
