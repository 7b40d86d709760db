"""One policy's trainable state as one object: what a worker holds per policy, the update trains, and a checkpoint
saves and loads.

    policy = PolicyState(model, config, groups, layout, device)
    learner.train(policy, episodes, group_index)        # allsync/update/learner.py: one update of this policy
    policy.version += 1                                  # the worker, once the update is done

It holds the adapter tensors (the LoRA parameters attached to `model`: its routed experts' block under expert
parallelism, the rest replicated), the critic when the estimator learns one (allsync/update/critic.py), AdamW over
both (one param group each, moments held from the start), the flat gradient buffers the workers all-reduce, the
adapter version (the warm-up's step counts follow from it: optimizer.group_steps) and the count of consecutive
steps with a non-finite loss. Nothing in it knows how episodes were generated or how the update runs.

Several policies on one base: the first takes the adapter attached to the model; another (`seed` given) gets LoRA
tensors of its own, drawn as moe_lora.lora.seeded_init_ draws them, and `attach` puts a policy's tensors into the
model's LoRA modules (the frozen base is shared; only the adapters' Parameter objects change places).
"""

from __future__ import annotations

import torch

from allsync.update.critic import Critic
from allsync.update.optimizer import allocate_adamw_state, flat_gradients, group_steps, warmup_lr
from moe_lora.expert_parallel import expert_parameters
from moe_lora.lora import adapter_parameters, seeded_init_, set_adapter_parameters


class PolicyState:
    def __init__(self, model, config, groups, layout, device: torch.device, seed: int | None = None):
        """groups: allsync.distributed.process_groups.Groups (its broadcast makes the replicas start identical
        whatever their seeds); layout: the ExpertLayout or None. seed None: the adapter attached to `model` is this
        policy's; else a new adapter of the same shapes drawn from `seed`, attached to `model` from now on."""
        self.config = config
        if seed is not None:
            fresh = {name: torch.nn.Parameter(torch.empty_like(p)) for name, p in adapter_parameters(model).items()}
            set_adapter_parameters(model, fresh)
            seeded_init_(model, seed)
        self.adapter = adapter_parameters(model)  # name -> Parameter, as attached to the model
        self.lora_params = list(self.adapter.values())
        sharded = {id(p) for p in expert_parameters(model)} if layout is not None else set()
        self.expert_params = [p for p in self.lora_params if id(p) in sharded]  # summed over the EDP group
        self.replicated_lora_params = [p for p in self.lora_params if id(p) not in sharded]
        self.critic = Critic(model, config.run.seed) if config.algorithm.uses_critic else None
        self.value_params = list(self.critic.trainable_tensors().values()) if self.critic is not None else []
        self.params = self.replicated_lora_params + self.value_params  # summed over every rank
        self.flat_grad = flat_gradients(self.params, device=device)  # every rank all-reduces one buffer per minibatch
        self.flat_expert_grad = flat_gradients(self.expert_params, flag=False, device=device)
        for p in self.params:
            groups.broadcast(p.data)
        self.optimized = self.lora_params + self.value_params
        self.optimizer = torch.optim.AdamW(
            [{"params": self.lora_params}] + ([{"params": self.value_params}] if self.value_params else [])
        )
        allocate_adamw_state(self.optimizer)  # before a colocated engine measures the memory left free
        self.apply_optim_settings()
        self.version = 0  # the adapter's: updates done (sampling checks it, staleness 0)
        self.consecutive_nan = 0  # steps in a row with a non-finite loss (run.max_consecutive_nan stops the run)

    def attach(self, model) -> None:
        """This policy's LoRA tensors into `model`'s LoRA modules (the policy its forwards then run)."""
        set_adapter_parameters(model, self.adapter)

    def optim_settings(self) -> list[dict]:
        """Per AdamW param group (the adapter's, then the critic's), the settings the config gives it."""
        o = self.config.optim
        common = {"betas": tuple(o.betas), "weight_decay": o.weight_decay}
        return [{"base_lr": o.lr, "lr": o.lr, **common}, {"base_lr": o.value_lr, "lr": o.value_lr, **common}][
            : len(self.optimizer.param_groups)
        ]

    def apply_optim_settings(self) -> list[str]:
        """Set each param group's optim.* settings from the config (after loading a checkpoint, whose saved groups
        would otherwise override them); returns `key: old -> new` for each one that changed."""
        changed = []
        for index, (group, settings) in enumerate(zip(self.optimizer.param_groups, self.optim_settings())):
            for key, value in settings.items():
                if key != "lr" and key in group and group[key] != value:
                    changed.append(f"param group {index} {key}: {group[key]} -> {value}")
                group[key] = value
        return changed

    def set_warmup_lrs(self) -> None:
        """Each param group's learning rate at this version (optimizer.warmup_lr of its own step count)."""
        steps = group_steps(self.version, self.config.algorithm)
        for group, step in zip(self.optimizer.param_groups, steps):
            group["lr"] = warmup_lr(group["base_lr"], step, self.config.optim.warmup_steps)

    @property
    def critic_only(self) -> bool:
        """Value pretraining: the first algorithm.value_pretrain_steps updates train the critic only (version 0
        trains step 1)."""
        return self.version < self.config.algorithm.value_pretrain_steps

    def untrained_params(self, totals: torch.Tensor) -> list[torch.nn.Parameter]:
        """The parameters AdamW must not step on a minibatch (optimizer.step_skipping): a model with no token in it on
        any worker (totals = [policy tokens, episodes, critic tokens], all-reduced) has a zero gradient, and a step
        would still move it by momentum and weight decay and advance its bias correction. The policy's also during
        value pretraining (its loss is not backpropagated). The critic's when no row of the minibatch has a value
        target (T-PPO: every reply of it cut at a window); the policy's when every reply was filtered."""
        skipped = self.lora_params if self.critic_only or totals[0] == 0 else []
        return skipped + (self.value_params if totals[2] == 0 else [])

    def zero_grads(self) -> None:
        self.flat_grad.zero_()
        self.flat_expert_grad.zero_()

    def value_grad_norm(self) -> torch.Tensor:
        """||g|| of the critic's adapter and head (replicated: the same on every rank); 0 without a critic. The critic
        is its own model (T-PPO optimizes policy and value independently): its gradient is clipped and logged apart."""
        return (
            torch.nn.utils.get_total_norm([p.grad for p in self.value_params]) if self.value_params else torch.zeros(())
        )
