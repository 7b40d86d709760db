"""A worker's part of a training checkpoint (the files in allsync/run/checkpoint.py's layout).

    state = ShardedTrainingState(model, policy, groups, layout, rank, config)
    state.save(directory, rank_meta)      # every rank: the whole adapter + AdamW + version from rank 0
    rank_meta = state.load(directory)     # every rank: its own block back, the policy's version set

Under expert parallelism each rank holds the routed-expert LoRA tensors (and their AdamW moments) of its
block of E/k experts only. The files never depend on parallel.expert_parallel: on save the ranks of the first
expert-parallel group gather their blocks into whole [E, ...] tensors on rank 0 (one collective); on load each
rank keeps the rows of its own block, whatever k wrote them.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

from allsync.run.checkpoint import (
    CRITIC_PREFIX,
    optimizer_state_from_files,
    optimizer_state_to_files,
    read_state,
    rng_state,
    set_rng_state,
    write_state,
)
from allsync.config import RunConfig
from allsync.update.optimizer import load_adamw_state_in_place
from allsync.update.policy_state import PolicyState
from moe_lora.lora import PEFT_PREFIX, LoRAExperts, expert_slots, load_lora_state_dict, lora_state_dict


class ShardedTrainingState:
    """The adapter and optimizer state of one worker, gathered whole for the files and sharded back at load."""

    def __init__(self, model, policy: PolicyState, groups, layout, rank: int, config: RunConfig):
        """policy: the one policy's state (allsync/update/policy_state.py) whose LoRA tensors are attached to `model`;
        groups: the process groups its gradients are reduced over (the expert-parallel gathers go through them)."""
        self.model, self.policy, self.groups, self.layout = model, policy, groups, layout
        self.rank, self.config = rank, config

    def adapter_tensors(self) -> dict[str, torch.Tensor]:
        """This rank's adapter tensors under PEFT names (its expert block only, under expert parallelism)."""
        return lora_state_dict(self.model)

    def full_adapter_tensors(self) -> dict[str, torch.Tensor] | None:
        """The whole adapter, every routed expert included, on rank 0 (None on the others), in CPU memory.
        Under expert parallelism the ranks of the first EP group gather their blocks, so each of them must call it."""
        if self.layout is None:
            return {k: v.to("cpu", copy=True) for k, v in self.adapter_tensors().items()} if self.rank == 0 else None
        modules = [(n, m) for n, m in self.model.named_modules() if isinstance(m, LoRAExperts)]
        full = self.gather_expert_blocks([t.detach() for _, m in modules for t in m.factors()])
        if full is None:
            return None
        tensors = {k: v for k, v in self.adapter_tensors().items() if ".mlp.experts." not in k}
        for i, (name, _) in enumerate(modules):
            tensors.update(expert_slots(PEFT_PREFIX + name, full[6 * i : 6 * i + 6]))
        return {k: v.to("cpu", copy=True) for k, v in tensors.items()}

    def gather_expert_blocks(self, blocks: list[torch.Tensor]) -> list[torch.Tensor] | None:
        """[E, ...] tensors from every rank's [E/k, ...] blocks of them, gathered over the first EP group in
        one collective: the result on rank 0, None on the others (ranks outside that group do nothing)."""
        if self.rank >= self.layout.ep_size:
            return None
        flat = torch.cat([b.reshape(-1) for b in blocks]) if blocks else torch.zeros(0)
        pieces = [p.split([b.numel() for b in blocks]) for p in self.groups.all_gather(flat.cpu(), "ep")]
        if self.rank != 0:
            return None
        return [torch.cat([piece[i].view(b.shape) for piece in pieces]) for i, b in enumerate(blocks)]

    def expert_state_ids(self) -> list[int]:
        """Optimizer-state indices (into the flattened param groups) of the routed-expert LoRA tensors."""
        sharded = {id(p) for p in self.policy.expert_params}
        return [i for i, p in enumerate(self.policy.optimized) if id(p) in sharded]

    def full_optimizer_state(self) -> dict | None:
        """AdamW's state_dict with each expert tensor's moments gathered to [E, ...] (rank 0; None elsewhere)."""
        state = self.policy.optimizer.state_dict()
        if self.layout is None:
            return state if self.rank == 0 else None
        entries = [
            (i, name)
            for i in self.expert_state_ids()
            for name, v in sorted(state["state"].get(i, {}).items())
            if isinstance(v, torch.Tensor) and v.dim() > 0
        ]
        full = self.gather_expert_blocks([state["state"][i][name] for i, name in entries])
        if full is None:
            return None
        for i in {i for i, _ in entries}:  # state_dict() shares the live per-parameter dicts: copy before replacing
            state["state"][i] = dict(state["state"][i])
        for (i, name), tensor in zip(entries, full):
            state["state"][i][name] = tensor
        return state

    def shard_optimizer_state(self, state: dict) -> dict:
        """The inverse for loading: this rank's rows of each expert tensor's moments (any EP size wrote it)."""
        if self.layout is None:
            return state
        mine = self.layout.experts_of(self.rank)
        for i in self.expert_state_ids():
            for name, v in state["state"].get(i, {}).items():
                if isinstance(v, torch.Tensor) and v.dim() > 0:
                    state["state"][i][name] = v[mine.start : mine.stop].clone()
        return state

    def save(self, directory: str | Path, rank_meta: dict) -> None:
        """The policy from rank 0: the whole adapter (expert blocks gathered), AdamW state, critic and version; from
        every rank its RNG states, the policy's count of consecutive non-finite steps and `rank_meta` (data position,
        producer state)."""
        directory = Path(directory)
        adapter_tensors, optimizer_state = self.full_adapter_tensors(), self.full_optimizer_state()
        if self.rank == 0:
            from moe_lora.adapter_io import Adapter, write_peft_adapter

            lc = self.config.lora
            adapter = Adapter(adapter_tensors, lc.rank, lc.alpha, lc.use_rslora)
            write_peft_adapter(adapter, directory / "adapter", self.config.model.base, overwrite=True)
            tensors, meta = optimizer_state_to_files(optimizer_state)
            if self.policy.critic is not None:
                critic = self.policy.critic.trainable_tensors()
                tensors.update({CRITIC_PREFIX + k: v.detach().clone() for k, v in critic.items()})
            write_state(directory, "trainer", tensors, {"optimizer": meta, "adapter_version": self.policy.version})
        rng_tensors, rng = rng_state()
        write_state(
            directory,
            f"rank{self.rank}",
            rng_tensors,
            {"rng": rng, "consecutive_nan": self.policy.consecutive_nan, **rank_meta},
        )

    def load(self, directory: str | Path) -> dict:
        """Back into the model and optimizer: the adapter (this rank's expert block), AdamW's state (this
        config's optim settings win over the saved ones, each change named), the critic and the policy's version and
        count of non-finite steps, then this rank's RNG states. Returns this rank's saved meta."""
        directory = Path(directory)
        trainer_tensors, trainer = read_state(directory, "trainer")
        mine_tensors, mine = read_state(directory, f"rank{self.rank}")
        load_lora_state_dict(
            self.model,
            load_file(directory / "adapter" / "adapter_model.safetensors"),
            other_experts=self.layout is not None,
        )
        saved = optimizer_state_from_files(trainer_tensors, trainer["optimizer"])
        load_adamw_state_in_place(
            self.policy.optimizer, self.shard_optimizer_state(saved), str(directory / "trainer.safetensors")
        )
        changed = self.policy.apply_optim_settings()
        if changed and self.rank == 0:
            print(f"note: resumed with this config's optim settings: {'; '.join(changed)}", file=sys.stderr)
        if self.policy.critic is not None:
            critic = {k[len(CRITIC_PREFIX) :]: v for k, v in trainer_tensors.items() if k.startswith(CRITIC_PREFIX)}
            self.policy.critic.load_trainable(critic, str(directory / "trainer.safetensors"))
        set_rng_state(mine_tensors, mine["rng"])
        self.policy.version, self.policy.consecutive_nan = trainer["adapter_version"], mine["consecutive_nan"]
        return mine
