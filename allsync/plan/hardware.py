"""The machines a plan's step time is computed for: one GPU's peak rates and memory, its links, and the shares of
those peaks our code reaches (measured where we have measured them, named as assumptions where we have not).

Sources:
    peak bf16 dense FLOP/s, HBM bandwidth   NVIDIA's H100 SXM5 and H200 SXM datasheets (989 TFLOP/s; 3.35 / 4.8 TB/s)
    train_efficiency                      measured: the trainer's forward + backward of one sequence through
                                          DeepSeek-V3's real layers on an H200, without activation checkpointing, by
                                          `step_time.sequence_forward_flops`: 21,504 tokens reach 26.4% (NF4 routed
                                          experts) and 29.8% (FP8) of the peak, 4,096 tokens 11.7% and 11.9%
                                          (benchmarks/measured/v3_layer_memory_h200.json; tests/allsync/
                                          test_plan_step.py recomputes them). Between the points it is interpolated
                                          in log(tokens per forward), beyond them the nearest is taken (`--json`
                                          shows the points); bf16 and int8 were not measured and are taken as FP8's
                                          and NF4's
    decode_bandwidth_efficiency           assumed 0.7 of HBM bandwidth for a decode step's weight and KV reads (not
                                          measured here: the lent GPUs have no vLLM)
    vLLM's decode step                    the roofline times the factor published DeepSeek-V3 serving runs measure
                                          against it, over the share of no-LoRA decode expert LoRA keeps (sources
                                          and numbers in vllm_decode.py)
    decode_flops_share                    assumed: the share of the peak a decode step's FLOPs run at (the weights'
                                          matmuls of its rows, the latent attention's 17 MFLOP a cached token at
                                          DeepSeek-V3's shape); None takes train_efficiency's (the measured training
                                          share) until a GPU measures the decode kernels (`allsync plan
                                          --decode-flops-share`)
    a2a bandwidth (training, prefill)     DeepEP's normal kernels as its README reports them on H800 + 400 Gb/s
                                          InfiniBand: about 153 GB/s per GPU inside a node (NVLink), 43 GB/s across
                                          nodes (RDMA)
    a2a latency (decode)                  DeepEP's low-latency kernels, README: dispatch + combine of 128 tokens
                                          (hidden 7168, top-8) = 191 us at EP 8, 313 at 16, 428 at 32, 487 at 64,
                                          561 at 128, 554 at 256
    all-reduce bandwidth                  the same RDMA 43 GB/s per GPU once a group spans nodes, NVLink's otherwise
    memory                                what torch reports as the device's total (torch.cuda.get_device_properties(
                                          0).total_memory, the total vLLM's and our memory share divide): H100 SXM
                                          80 GB 81,082-81,090 MiB and H200 143,156 MiB in public torch printouts
                                          (`_CudaDeviceProperties(..., total_memory=81089MB)`; torch's "MB" is MiB);
                                          NVML (nvidia-smi) shows more, 81,559 and 143,771 MiB (the lent H200's),
                                          which includes memory no process can allocate. The CUDA context and NCCL's
                                          buffers come out of this total too: they are in the plan's margin (fit.py)
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

# (tokens per forward, share of the peak) by the routed experts' format (module docstring)
TRAIN_EFFICIENCY_POINTS = {
    "nf4": ((4096, 0.117), (21504, 0.264)),
    "fp8": ((4096, 0.119), (21504, 0.298)),
}
TRAIN_EFFICIENCY_POINTS.update(bf16=TRAIN_EFFICIENCY_POINTS["fp8"], int8=TRAIN_EFFICIENCY_POINTS["nf4"])
TRAIN_EFFICIENCY = {fmt: points[-1][1] for fmt, points in TRAIN_EFFICIENCY_POINTS.items()}  # at the largest forward
DECODE_A2A_SECONDS = {8: 191e-6, 16: 313e-6, 32: 428e-6, 64: 487e-6, 128: 561e-6, 256: 554e-6}


@dataclass(frozen=True)
class Hardware:
    name: str
    memory_bytes: int
    flops: float  # bf16 dense peak, FLOP/s
    hbm_bytes_per_second: float
    gpus_per_node: int = 8
    nvlink_bytes_per_second: float = 153e9  # all-to-all, per GPU, inside a node
    network_bytes_per_second: float = 43e9  # all-to-all and all-reduce, per GPU, across nodes
    host_link_bytes_per_second: float = 25e9  # GPU <-> host (sleep mode's transfers)
    decode_bandwidth_efficiency: float = 0.7  # assumed
    decode_flops_share: float | None = None  # assumed; None: train_efficiency's (module docstring)
    # the torch engine's graphed decode step over its rooflines (torch_decode.GraphedDecodeFactors); None: as measured
    # on the H200 (torch_decode.GRAPHED_H200). Another: what the step would be with faster kernels (a what-if)
    decode_factors: object | None = None
    # vLLM's decode step over the roofline; None: the published runs' (vllm_decode.vllm_step_factor)
    vllm_decode_factor: float | None = None
    # the share of no-LoRA decode vLLM keeps with LoRA on the routed experts; None: vllm_decode.EXPERT_LORA_DECODE_SHARE
    expert_lora_decode_share: float | None = None

    def train_efficiency(self, routed_format: str, tokens: float | None = None) -> float:
        """The share of the peak a training forward of `tokens` (padded) tokens reaches (None: the largest measured
        forward's): the measured points interpolated in log(tokens), the nearest beyond them."""
        points = TRAIN_EFFICIENCY_POINTS[routed_format]
        if tokens is None:
            return points[-1][1]
        sizes, shares = zip(*points)
        return float(np.interp(np.log(tokens), np.log(sizes), shares))

    def decode_flops(self, routed_format: str) -> float:
        """FLOP/s of a decode step: decode_flops_share of the peak, or the training share (module docstring)."""
        share = self.decode_flops_share if self.decode_flops_share is not None else self.train_efficiency(routed_format)
        return self.flops * share

    def link_bytes_per_second(self, group: int) -> float:
        """Per-GPU bandwidth of a collective over `group` GPUs: NVLink inside a node, the network once it spans
        nodes (the slower link bounds the collective)."""
        return self.nvlink_bytes_per_second if group <= self.gpus_per_node else self.network_bytes_per_second

    def decode_a2a_seconds(self, group: int) -> float:
        """One MoE layer's dispatch + combine in a decode step over `group` GPUs (0 without expert parallelism)."""
        if group <= 1:
            return 0.0
        known = sorted(DECODE_A2A_SECONDS)
        return DECODE_A2A_SECONDS[min((g for g in known if g >= group), default=known[-1])]


MiB = 1 << 20
GPUS = {  # memory: torch's total_memory (module docstring)
    "h100": Hardware("H100 SXM 80 GB", 81_089 * MiB, 989e12, 3.35e12),
    "h200": Hardware("H200 SXM 141 GB", 143_156 * MiB, 989e12, 4.8e12),
}


def hardware(name: str, memory_bytes: int | None = None, host_link: float | None = None) -> Hardware:
    """The preset `name` (`--gpu`), with the memory and host link the flags give, if they give them."""
    if name not in GPUS:
        raise ValueError(f"--gpu {name!r}: known GPUs are {', '.join(sorted(GPUS))}")
    hw = GPUS[name]
    if memory_bytes is not None:
        hw = replace(hw, memory_bytes=memory_bytes)
    if host_link is not None:
        hw = replace(hw, host_link_bytes_per_second=host_link)
    return hw
