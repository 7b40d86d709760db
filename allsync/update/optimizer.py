"""AdamW over a policy's trainable tensors: the flat gradient buffers the workers all-reduce, warm-up, the moments
held from the start and loaded in place, and a step that leaves untrained models alone."""

from __future__ import annotations

import torch


def flat_gradients(
    params: list[torch.nn.Parameter], flag: bool = True, device: torch.device | None = None
) -> torch.Tensor:
    """One zeroed buffer holding every parameter's .grad as a view, plus (flag) one last slot for a flag (a
    rank's non-finite loss): a minibatch's gradients and the flag are all-reduced in one collective."""
    if not params:
        return torch.zeros(int(flag), device=device)
    dtypes = {p.dtype for p in params}
    if len(dtypes) != 1:
        raise TypeError(
            f"trainable parameters have several dtypes {sorted(map(str, dtypes))}; one flat gradient buffer needs one"
        )
    flat = torch.zeros(sum(p.numel() for p in params) + int(flag), dtype=params[0].dtype, device=params[0].device)
    offset = 0
    for p in params:
        p.grad = flat[offset : offset + p.numel()].view_as(p)
        offset += p.numel()
    return flat


def warmup_lr(lr: float, step: int, warmup_steps: int) -> float:
    """lr(step) = lr * clamp((step + 1) / warmup_steps, 0, 1), step counted from 0 (a param group's own step: the
    policy's is negative during value pretraining, where its group is not stepped)."""
    return lr * min(1.0, max(0.0, (step + 1) / warmup_steps)) if warmup_steps > 0 else lr


def allocate_adamw_state(optimizer: torch.optim.Optimizer) -> None:
    """AdamW's state of every parameter now, as its first step would create it (step 0, zero moments exp_avg and
    exp_avg_sq shaped like the parameter), which that step then finds and continues: the same updates. The moments
    (2 x the adapter's bytes; 4 GB per GPU in the 671B config) are held from the start, so a vLLM engine built
    next sees them gone from the free memory its share is read from (rollout.gpu_memory_utilization None), instead
    of the first optimizer.step() allocating them after the engine took that memory for its KV cache."""
    step_dtype = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32  # AdamW's own
    for group in optimizer.param_groups:
        if group.get("fused") or group.get("capturable") or group.get("amsgrad"):
            raise ValueError("allocate_adamw_state builds the plain AdamW's state (no fused, capturable or amsgrad)")
        for p in group["params"]:
            state = optimizer.state[p]
            if not state:
                state["step"] = torch.tensor(0.0, dtype=step_dtype, device="cpu")
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)


def load_adamw_state_in_place(optimizer: torch.optim.Optimizer, saved: dict, source: str) -> None:
    """Optimizer.load_state_dict into the state tensors `allocate_adamw_state` holds, copied in place: a resume
    never holds two copies of the moments beside a colocated engine (load_state_dict builds new tensors first). A
    parameter with no saved state (never stepped) gets a fresh one: step 0, zero moments. The saved param groups'
    options are taken too (then PolicyState.apply_optim_settings sets the config's)."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    saved_counts = [len(group["params"]) for group in saved["param_groups"]]
    if saved_counts != [len(group["params"]) for group in optimizer.param_groups]:
        raise ValueError(
            f"{source}: the saved optimizer has param groups of {saved_counts} tensors, this run "
            f"{[len(g['params']) for g in optimizer.param_groups]} (another lora.rank / targets / critic?)"
        )
    for index, p in enumerate(params):
        values = saved["state"].get(index, {})
        for name, tensor in optimizer.state[p].items():
            if name not in values:
                tensor.zero_()
            elif tuple(values[name].shape) != tuple(tensor.shape):
                raise ValueError(
                    f"{source}: optimizer state {index}.{name} is {list(values[name].shape)}, this run's "
                    f"{list(tensor.shape)} (another lora.rank or lora.expert_layout?)"
                )
            else:
                tensor.copy_(values[name])
    for group, saved_group in zip(optimizer.param_groups, saved["param_groups"]):
        group.update({key: value for key, value in saved_group.items() if key != "params"})


def group_steps(adapter_version: int, algorithm) -> tuple[int, int]:
    """Each param group's own step count from 0, for its warm-up: the policy's (group 0) starts after the critic-only
    steps of value pretraining, the critic's (group 1) at version 0:
        policy step = version - value_pretrain_steps,  critic step = version."""
    return adapter_version - algorithm.value_pretrain_steps, adapter_version


def step_skipping(optimizer: torch.optim.Optimizer, skipped: list[torch.nn.Parameter]) -> None:
    """optimizer.step() that leaves `skipped` and their state untouched. AdamW steps every parameter whose .grad is
    not None: a zero gradient still advances state["step"], which shifts its bias correction
    (1 - beta^t) for every later update, and decays momentum. A parameter whose .grad is None is not visited, so the
    skipped ones' grads (views into the flat buffer) are set aside for the call and put back."""
    grads = [p.grad for p in skipped]
    for p in skipped:
        p.grad = None
    try:
        optimizer.step()
    finally:
        for p, grad in zip(skipped, grads):
            p.grad = grad
