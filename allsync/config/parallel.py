"""The `parallel:` section: workers, devices, expert and tensor parallelism, the layout."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ParallelSection:
    """Worker layout. Each worker is one GPU (or one CPU process)."""

    nodes: int = 1
    workers_per_node: int = 2
    expert_parallel: int = 1  # routed experts sharded over this many workers (must divide the expert count)
    tensor_parallel: int = 1  # only 1: no tensor parallelism in the loop
    layout: str = "colocated"  # colocated (all-sync) | disaggregated (half generate, half train)
    device: str = "auto"  # auto (cuda when a GPU is visible) | cpu | cuda
    backend: str = "auto"  # process groups: auto (nccl on cuda, gloo on cpu) | gloo | nccl

    def resolved_device(self) -> str:
        import torch

        return ("cuda" if torch.cuda.is_available() else "cpu") if self.device == "auto" else self.device

    def resolved_backend(self) -> str:
        return ("nccl" if self.resolved_device() == "cuda" else "gloo") if self.backend == "auto" else self.backend

    @property
    def workers(self) -> int:
        return self.nodes * self.workers_per_node

    def check(self, fail) -> None:
        if self.layout not in ("colocated", "disaggregated"):
            fail(f"parallel.layout = {self.layout!r}: use colocated or disaggregated")
        if self.layout == "disaggregated" and (self.workers < 2 or self.workers % 2):
            fail(
                f"parallel.layout disaggregated needs an even number >= 2 of workers (nodes x workers_per_node = {self.workers})"
            )
        if self.tensor_parallel != 1:
            fail(
                f"parallel.tensor_parallel = {self.tensor_parallel}: the loop has no tensor parallelism; use 1 (routed experts "
                "shard with parallel.expert_parallel)"
            )
        if self.expert_parallel < 1 or self.workers % self.expert_parallel:
            fail(
                f"parallel.expert_parallel = {self.expert_parallel} must divide the {self.workers} workers (nodes x workers_per_node)"
            )
        if self.expert_parallel > 1 and self.layout != "colocated":
            fail(f"parallel.expert_parallel = {self.expert_parallel} with parallel.layout {self.layout}: use colocated")
        if self.device not in ("auto", "cpu", "cuda"):
            fail(f"parallel.device = {self.device!r}: use auto, cpu or cuda")
        if self.backend not in ("auto", "gloo", "nccl"):
            fail(f"parallel.backend = {self.backend!r}: use auto, gloo or nccl")
        if self.backend == "gloo" and self.resolved_device() == "cuda" and self.expert_parallel > 1:
            fail(
                f"parallel.backend = gloo with parallel.device cuda and expert_parallel {self.expert_parallel}: gloo has no "
                "all-to-all for GPU tensors; use nccl (or auto)"
            )
        if self.resolved_backend() == "nccl" and self.resolved_device() != "cuda":
            fail(
                f"parallel.backend = nccl with parallel.device {self.device} (runs on cpu): NCCL needs GPUs; use gloo or auto"
            )
