"""The torch engine's decode step as CUDA graphs (rollout.decode_graphs).

Measured on an H200 (BENCHMARKS.md, "The torch engine's decode step on a GPU"), the eager decode step is host-bound:
about 7 ms per decoder layer of Python and kernel launches, plus a host round per routed expert, whatever the rows.
A CUDA graph replays a captured step's kernels with one launch. What it needs, and how the step provides it:

    fixed shapes       `FixedShapeStep` decodes every slot of the pool (a free slot a pad token), attending to a span
                       from `span_bucket` (8 per doubling): one graph per span, the slots fixed per engine;
    no host read       the routed experts run in fixed shapes (quant.fixed_shape_experts: grouped_mm offsets
                       computed on the device, every expert held dequantized); the mask, the lengths and the
                       sampling (counter-based Gumbel draws) are device tensors;
    fixed addresses    the step reads its inputs from static buffers (copied in before each replay) and the KV pool's
                       buffers, allocated before the first capture; its outputs are copied out after each replay.

A span's first use runs the step once eagerly on a side stream (library warm-up), restores the pool's lengths,
captures, then replays; the graphs of one pool share a memory pool. The routing record (moe_lora.routing.recording)
sees the captured router outputs once, at capture: they are taken out of the record and a copy of each is appended
after every replay, so the record holds what the eager step would have appended. Under expert parallelism the
experts' exchange is all-to-alls of equal splits (moe_lora.expert_parallel.ExpertDispatch.fixed_shape), every rank
steps every slot at the span the ranks agreed on, so every rank warms up, captures and replays the same steps
together (a warm-up's collectives meet the other ranks' warm-ups).
"""

from __future__ import annotations

import torch

from allsync.engines.slots import FixedShapeStep


class GraphedStep:
    """A FixedShapeStep captured as one torch.cuda.CUDAGraph per span and replayed (module docstring). Same call as
    FixedShapeStep: (last, live, seeds, steps [slots], span) -> (tokens, logprobs [slots])."""

    def __init__(self, step: FixedShapeStep, record=None):
        self.step, self.record = step, record
        slots, device = step.pool.slots, step.model.device
        self.inputs = (
            torch.zeros(slots, dtype=torch.long, device=device),  # last tokens
            torch.zeros(slots, dtype=torch.long, device=device),  # live
            torch.zeros(slots, dtype=torch.long, device=device),  # seeds
            torch.zeros(slots, dtype=torch.long, device=device),  # steps
        )
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, tuple, list]] = {}
        self.memory = torch.cuda.graph_pool_handle()

    def __call__(self, last, live, seeds, steps, span: int) -> tuple[torch.Tensor, torch.Tensor]:
        for buffer, value in zip(self.inputs, (last, live, seeds, steps)):
            buffer.copy_(value)
        if span not in self.graphs:
            self.graphs[span] = self.capture(span)
        graph, outputs, routed = self.graphs[span]
        graph.replay()
        if self.record is not None:
            for layer, indices in zip(self.record.calls, routed):
                layer.append(indices.clone())
        return outputs[0].clone(), outputs[1].clone()

    def _taken_from_record(self, before: list[int]) -> list[torch.Tensor]:
        """What the router wrappers appended since `before` (each layer's count), taken out of the record: the last
        entry of each layer."""
        if self.record is None:
            return []
        taken = []
        for layer, count in zip(self.record.calls, before):
            taken.append(layer[-1])
            del layer[count:]
        return taken

    def capture(self, span: int) -> tuple[torch.cuda.CUDAGraph, tuple, list]:
        """Warm up the step at `span` on a side stream, then capture it; the pool's lengths as they were."""
        lengths = self.step.pool.lengths.clone()
        counts = [len(layer) for layer in self.record.calls] if self.record is not None else []
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self.step(*self.inputs, span)
        torch.cuda.current_stream().wait_stream(side)
        self._taken_from_record(counts)
        self.step.pool.lengths.copy_(lengths)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.memory):
            outputs = self.step(*self.inputs, span)
        routed = self._taken_from_record(counts)
        self.step.pool.lengths.copy_(lengths)  # capture ran nothing, but keep the pool as it was in any case
        return graph, outputs, routed


def graphed_step(record=None):
    """A `fixed_step` factory for allsync.engines.slots.decode_in_slots: FixedShapeStep captured as CUDA graphs."""
    return lambda model, pool, sampling: GraphedStep(FixedShapeStep(model, pool, sampling), record)
