"""What one step's work costs on a GPU: FLOPs and bytes of DeepSeek-V3's layers, turned into seconds by a roofline.

Forward FLOPs of one token that attends to c earlier tokens (h hidden, H heads, MLA as trained, not absorbed):

    attention   2 (h q_lora + q_lora H (d_nope + d_rope) + h (kv_lora + d_rope) + kv_lora H (d_nope + d_v) + H d_v h)
                + 2 c H (d_nope + d_rope) + 2 c H d_v                        (projections; scores; weighted values)
    dense MLP   2 x 3 h inter
    MoE         2 x 3 h moe_inter (k + shared) + 2 h E                      (the k routed and the shared experts; router)
    after       2 h vocab                                                    (lm_head)

so a sequence of S tokens costs S x F(c = S / 2) (F is linear in c). Training a sequence runs it through the frozen
model `passes` times: forward 1, backward 2 (input gradients only: the base is frozen; LoRA's share is < 1%), the
recomputed forward of activation checkpointing 1, the old-logprob forward of a step with several minibatches 1, the
reference forward of a KL penalty 1; a critic's value forward 1, its forward 1 and backward 2 (recompute 1).
The learner trains rows packed into forwards padded to their longest row (`forward_seconds`; training.train_phase
packs them): seconds = FLOPs / (peak x hardware.train_efficiency at the forward's padded tokens), the efficiency
measured on the real layers (hardware.py), plus the MoE all-to-all (`a2a_seconds_per_token`): per routed token and
MoE layer, a copy of the hidden state (bf16) to each other GPU holding one of its experts and back (hierarchically,
once per node across nodes), once per forward-like pass and once in backward, at NVLink's and the network's per-GPU
all-to-all bandwidths.

A decode step of B sequences holding C tokens of context in all reads the weights the generator holds (routed
experts: the share a step's tokens touch, 1 - (1 - k / E)^(B x EP)) and C tokens of KV cache:

    t = max(bytes / (HBM x decode_bandwidth_efficiency), FLOPs / Hardware.decode_flops) + MoE layers x a2a latency

(decode_flops: peak x decode_flops_share, assumed, or x train_efficiency, the measured training share, by default)

The torch engine's step is not near that roofline: measured eager on the real layers it is host-bound, 25-44x the
copy-bandwidth roofline (torch_decode.py), so its `measured` step is the floor: t = max(roofline, measured) + a2a.
With rollout.decode_graphs (`fixed_shapes`: CUDA graphs of fixed-shape steps, allsync/engines/graphs.py) the host's
share is gone, and every held quantized weight is dequantized at every step, its bf16 copy written and read back:

    weights bytes = stored bytes of every held weight + 2 x 2 bytes x the quantized ones' parameters
                    (the routed experts' not counted with rollout.frozen_expert_kernel triton: read once, as stored)
    t = max(FLOPs / decode_flops, w(B) x weights bytes / bandwidth + kv x cache bytes / bandwidth) + a2a

with w and kv the graphed step's measured time over those two rooflines on an H200 (torch_decode.GRAPHED_H200:
weights 2.2-2.6x with the dequantizing experts, 22-33x with the NF4 expert kernel; cache 3.3x on the torch path (its latent reads and 128 heads' scores counted),
44x with the latent kernel),
and the step is that of every slot of the pool, free ones included, each reading the span the longest live row needs
(allsync.engines.slots.span_bucket): B = slots and C = slots x span (`generation_timeline`), not the live rows'
own contexts.

Prefill is a forward of the prompt (FLOP-bound). `generation_timeline` runs continuous batching over one GPU's
sequences the way vLLM's scheduler does: admission while the context fits, preemption with recomputation when the
cache is full. The torch engine batches continuously too, over rollout.decode_batch slots preallocated at full length
(so it never preempts). Attention reads each cached
token once per step: in latent space (vLLM, and the torch engine at DeepSeek-V3's shape) it costs more FLOPs per
cached token than expanded keys and values would (`decode_attention_flops_per_token`).
"""

from __future__ import annotations

import collections
import functools
import heapq
from dataclasses import dataclass

import numpy as np

from allsync.engines.slots import span_bucket
from allsync.plan.hardware import Hardware
from allsync.plan.torch_decode import GraphedDecodeFactors, TorchDecodeRates

BF16 = 2
ADMISSION_HEADROOM_TOKENS = 16


def attention_projection_params(config: dict) -> int:
    h, heads = config["hidden_size"], config["num_attention_heads"]
    nope, rope, v = config["qk_nope_head_dim"], config["qk_rope_head_dim"], config["v_head_dim"]
    q_lora, kv_lora = config["q_lora_rank"], config["kv_lora_rank"]
    return (
        h * q_lora
        + q_lora * heads * (nope + rope)
        + h * (kv_lora + rope)
        + kv_lora * heads * (nope + v)
        + heads * v * h
    )


def moe_layers(config: dict) -> int:
    return config["num_hidden_layers"] - config["first_k_dense_replace"]


def forward_flops_per_token(config: dict, context: float) -> float:
    """F(c): forward FLOPs of one token attending to `context` tokens, every layer and the lm_head (module docstring)."""
    h, heads = config["hidden_size"], config["num_attention_heads"]
    attention = 2 * attention_projection_params(config) + 2 * context * heads * (
        config["qk_nope_head_dim"] + config["qk_rope_head_dim"] + config["v_head_dim"]
    )
    dense_mlp = 2 * 3 * h * config["intermediate_size"]
    experts = config["num_experts_per_tok"] + config.get("n_shared_experts", 0)
    moe = 2 * 3 * h * config["moe_intermediate_size"] * experts + 2 * h * config["n_routed_experts"]
    dense = config["first_k_dense_replace"]
    return (
        config["num_hidden_layers"] * attention
        + dense * dense_mlp
        + moe_layers(config) * moe
        + 2 * h * config["vocab_size"]
    )


FLOP_KEYS = (
    "hidden_size",
    "num_attention_heads",
    "qk_nope_head_dim",
    "qk_rope_head_dim",
    "v_head_dim",
    "q_lora_rank",
    "kv_lora_rank",
    "intermediate_size",
    "moe_intermediate_size",
    "num_experts_per_tok",
    "n_shared_experts",
    "n_routed_experts",
    "first_k_dense_replace",
    "num_hidden_layers",
    "vocab_size",
)


@functools.lru_cache(maxsize=64)
def _coefficients(values: tuple) -> tuple[float, float]:
    config = {k: v for k, v in zip(FLOP_KEYS, values) if v is not None}
    f0 = forward_flops_per_token(config, 0.0)
    return f0, forward_flops_per_token(config, 1.0) - f0


def flop_coefficients(config: dict) -> tuple[float, float]:
    """(F(0), dF/dc): F(c) = F(0) + c dF/dc (module docstring), cached per shape (the plan asks millions of times)."""
    return _coefficients(tuple(config.get(k) for k in FLOP_KEYS))


def causal_flops(f0: float, slope: float, tokens):
    """S x F(S / 2) = S (F(0) + dF/dc S / 2): a causal forward of S tokens (each attends to S / 2 on average)."""
    return tokens * (f0 + slope * tokens / 2)


def sequence_forward_flops(config: dict, tokens) -> np.ndarray:
    """Forward FLOPs of whole sequences of `tokens` tokens (causal_flops)."""
    return causal_flops(*flop_coefficients(config), np.asarray(tokens, dtype=np.float64))


def train_passes(
    checkpointing: bool, minibatches: int, kl: bool, critic: bool = False, old_logprobs: str = "recompute"
) -> tuple[int, int]:
    """(FLOP passes, all-to-all passes) of training one sequence: forward 1 + backward 2 (+ recompute, + old-logprob
    forward when a step has several minibatches and algorithm.old_logprobs is recompute, + reference forward with a
    KL penalty); the backward moves the all-to-all's bytes once. A critic (PPO / T-PPO, allsync/update/critic.py) runs the
    frozen model again: its values before the update (a forward), then its own forward and backward (+ recompute)."""
    forwards = 1 + int(checkpointing) + int(minibatches > 1 and old_logprobs == "recompute") + int(kl)
    flops, a2a = forwards + 2, forwards + 1
    if critic:
        flops += 1 + 3 + int(checkpointing)
        a2a += 1 + 2 + int(checkpointing)
    return flops, a2a


def expected_places(config: dict, places: int) -> float:
    """Expected distinct places (`places` equal blocks of consecutive experts: the ranks of an EP group, or its nodes)
    that hold one or more of a token's k experts, the routing taken uniform: topk_group of the n_group expert groups,
    then k experts among the chosen groups' N = topk_group E / n_group (DeepSeek-V3's group-limited routing):

        places x sum_j P(j of a block's m groups chosen) (1 - C(N - j s, k) / C(N, k))

    with s the block's experts in each of its groups (a block inside one group: m = 1, s = E / places) and
    P(j) hypergeometric, C(m, j) C(n_group - m, topk_group - j) / C(n_group, topk_group).
    DeepSeek-V3 (256 experts, 8 groups, 4 chosen, top-8): 5.36 ranks of 16, 1.93 nodes of 2."""
    from math import comb

    experts, k = config["n_routed_experts"], config["num_experts_per_tok"]
    groups, chosen = config.get("n_group") or 1, config.get("topk_group") or 1
    per_group, per_block = experts // groups, experts // places
    block_groups, s = (1, per_block) if per_block <= per_group else (per_block // per_group, per_group)
    pool = chosen * per_group
    hit = sum(
        comb(block_groups, j)
        * comb(groups - block_groups, chosen - j)
        / comb(groups, chosen)
        * (1 - comb(pool - j * s, k) / comb(pool, k))
        for j in range(min(block_groups, chosen) + 1)
    )
    return places * hit


def a2a_seconds_per_token(config: dict, hw: Hardware, expert_parallel: int) -> float:
    """Seconds of one token's all-to-all in one forward-like pass over the MoE layers, as moe_lora.expert_parallel
    dispatches it: a row per (token, other rank holding one of its experts), h bf16 values and k ids and k weights
    (float32) out, h back; `expected_places` counts the ranks and nodes. An EP group inside a node moves
    its D_rank (EP - 1) / EP rows at NVLink's rate; one over n whole nodes of g of its ranks each goes hierarchically,
    the rail stage (a row per other node holding one of the token's experts, D_node (n - 1) / n) at the network's
    rate, then the node stage (a row per other rank of that node holding one, D_rank (g - 1) / g) at NVLink's, one
    after the other; a group the nodes do not split evenly, its flat rows at the network's rate."""
    if expert_parallel <= 1:
        return 0.0
    hidden, k = config["hidden_size"], config["num_experts_per_tok"]
    row = 2 * hidden * BF16 + 8 * k  # out (with k ids and k weights, float32) and back
    ranks = expected_places(config, expert_parallel)
    per_node = hw.gpus_per_node
    if expert_parallel > per_node and expert_parallel % per_node == 0:
        nodes = expert_parallel // per_node
        rail = expected_places(config, nodes) * (nodes - 1) / nodes * row / hw.network_bytes_per_second
        seconds = rail + ranks * (per_node - 1) / per_node * row / hw.nvlink_bytes_per_second
    else:  # one flat exchange: NVLink's rate inside a node, the network's once it spans nodes
        rows = ranks * (expert_parallel - 1) / expert_parallel
        seconds = rows * row / hw.link_bytes_per_second(expert_parallel)
    return moe_layers(config) * seconds


def forward_seconds(config: dict, hw: Hardware, fmt: str, passes: tuple[int, int], ep: int, rows, longest) -> float:
    """One training forward (with its backward) of `rows` rows padded to `longest` tokens on one GPU: every padded
    position computes and is routed. FLOPs passes x rows x sequence_forward_flops(longest) at the efficiency of
    rows x longest tokens per forward (hardware.train_efficiency), plus each position's all-to-all (module
    docstring)."""
    tokens = rows * longest
    flops = passes[0] * rows * float(sequence_forward_flops(config, longest))
    a2a = passes[1] * tokens * a2a_seconds_per_token(config, hw, ep)
    return flops / (hw.flops * hw.train_efficiency(fmt, tokens)) + a2a


def allreduce_seconds(nbytes: float, group: int, bytes_per_second: float) -> float:
    """A ring all-reduce of `nbytes` over `group` GPUs: 2 (n - 1) / n x bytes at `bytes_per_second` per GPU."""
    if group <= 1:
        return 0.0
    return 2 * (group - 1) / group * nbytes / bytes_per_second


@dataclass(frozen=True)
class DecodeCost:
    """A generator's per-step costs: the weights it reads (routed experts apart), its KV bytes per token, its
    expert-parallel group."""

    config: dict
    hw: Hardware
    routed_bytes: int  # the generator's routed experts (the share a step touches is read)
    other_bytes: int  # every other weight it holds (read every step)
    kv_bytes_per_token: int  # what a step moves per cached token (allsync.plan.fit.kv_step_bytes_per_token)
    expert_parallel: int
    routed_format: str
    attention_flops_per_cached_token: float | None = None  # decode_attention_flops_per_token; None: the expanded count
    # the torch engine's measured step (torch_decode.py), a floor under the roofline; None: the roofline alone
    measured: TorchDecodeRates | None = None
    # the torch engine's fixed-shape steps as CUDA graphs (rollout.decode_graphs): every held expert's
    # routed_params and every other quantized weight's other_params dequantized each step (`measured` is not applied)
    fixed_shapes: bool = False
    routed_params: float = 0.0
    other_params: float = 0.0
    # rollout.attention_kernel triton: a fixed-shape step's attention reads each slot's own positions (a free slot one),
    # not every slot up to the span (generation_timeline); kv_bytes_per_token is then the stored bytes
    own_positions: bool = False
    # rollout.frozen_expert_kernel triton: a fixed-shape step reads every held expert's stored bytes once
    # (quant.fused_experts), without the dequantized copy routed_params counts
    experts_read_once: bool = False
    # rollout.fp8_linear_kernel scaled_mm: a fixed-shape step multiplies fp8_linear_params of other_params (weights.
    # fp8_gemm_values) as FP8 GEMMs, read as stored without the dequantized copy (decode_step_seconds: assumed, not yet
    # measured inside a graphed step)
    fp8_linears_read_once: bool = False
    fp8_linear_params: float = 0.0
    # the graphed step's measured time over this roofline (torch_decode.GRAPHED_H200); None: the roofline alone
    graphed: GraphedDecodeFactors | None = None
    # vLLM's step over the roofline (allsync/plan/vllm_decode.py: published runs' factor / the expert-LoRA share)
    engine_factor: float = 1.0

    def touched(self, batch: float) -> float:
        """Share of the held routed experts a decode step's tokens reach: 1 - (1 - k / E)^(B x EP)."""
        k, experts = self.config["num_experts_per_tok"], self.config["n_routed_experts"]
        return 1.0 - (1.0 - k / experts) ** (batch * max(self.expert_parallel, 1))

    def fixed_shape_weight_bytes(self) -> float:
        """Bytes a fixed-shape step moves for its weights: every held one as stored, each quantized one's bf16 copy
        written and read back (the routed experts' not with rollout.frozen_expert_kernel triton, nor the FP8 linears'
        with rollout.fp8_linear_kernel scaled_mm: read as stored)."""
        copies = self.other_params + (0 if self.experts_read_once else self.routed_params)
        return self.routed_bytes + self.other_bytes + 2 * BF16 * copies - self.fp8_gemm_saved_bytes()

    def fp8_gemm_saved_bytes(self) -> float:
        """The FP8 linears' bf16 copies a fixed-shape step no longer writes and reads back with
        rollout.fp8_linear_kernel scaled_mm: 2 x 2 bytes a value of fp8_linear_params (0 without it)."""
        return 2 * BF16 * self.fp8_linear_params if self.fp8_linears_read_once else 0.0

    def graphed_factors(self, batch: float) -> tuple[float, float]:
        """(w, kv) of `graphed` for this cost's routed format and decode kernels, at `batch` slots."""
        kernels = ("triton" if self.experts_read_once else "dequantize", "triton" if self.own_positions else "torch")
        return self.graphed.factors(self.routed_format, *kernels, batch)

    def decode_step_seconds(self, batch: float, context: float) -> float:
        """One decode step of `batch` sequences holding `context` tokens of context in all (module docstring)."""
        f0, slope, flops_per_second, bytes_per_second, a2a_seconds, _ = self._rates
        per_cached = slope if self.attention_flops_per_cached_token is None else self.attention_flops_per_cached_token
        compute = (batch * f0 + per_cached * context) / flops_per_second
        cache = context * self.kv_bytes_per_token / bytes_per_second
        if self.fixed_shapes:
            weights = self.fixed_shape_weight_bytes() / bytes_per_second
            if self.graphed is not None:
                w, kv = self.graphed_factors(batch)
                # FP8 GEMMs: the measured step less the FP8 linears' copies S, priced at the factor of the step that
                # dequantizes (where those copies were measured, c): w B + max(w - c, 0) S. Never below w B, the
                # bytes still read at this step's own factor (w (B + S) - c S would be, for a kernel faster than c)
                saved = self.fp8_gemm_saved_bytes() / bytes_per_second
                copies_factor = self.graphed.factors(self.routed_format, "dequantize", "torch", batch)[0]
                weights_seconds = w * weights + max(w - copies_factor, 0.0) * saved
                return max(compute, weights_seconds + kv * cache) + self.gathered_exchange_seconds(batch)
            return max(compute, weights + cache) + self.gathered_exchange_seconds(batch)
        weights = (self.routed_bytes * self.touched(batch) + self.other_bytes) / bytes_per_second
        roofline = max(weights + cache, compute)
        if self.measured is not None:
            measured = self.measured.step_seconds(self.config, batch, context, self.expert_parallel, self.routed_format)
            roofline = max(roofline, measured)
        return (roofline + a2a_seconds) * self.engine_factor

    def gathered_exchange_seconds(self, batch: float) -> float:
        """The fixed-shape step's expert exchange (moe_lora.expert_parallel's `fixed_shape`: equal splits, no host
        read), every MoE layer: all-to-alls that send each of the rank's `batch` rows to every other rank of the EP
        group (h bf16 values, k int64 ids, k float32 weights) and one that sends each rank its rows' shares back (h
        bf16). Per rank and direction, rows x row bytes to each of the g - 1 other ranks of its node at NVLink's rate
        and to each of the EP - g others at the network's, one after the other (an upper count; in parallel the
        larger alone). DeepSeek-V3 at EP 16 over two nodes, 128 slots: 49.3 ms a step (39.6 in parallel), where
        DeepEP's dispatch and combine, which the eager step's exchange is priced at, take 18.2."""
        ep = self.expert_parallel
        if ep <= 1:
            return 0.0
        hidden, k = self.config["hidden_size"], self.config["num_experts_per_tok"]
        inside = min(ep, self.hw.gpus_per_node) - 1
        across = ep - 1 - inside

        def one_way(row_bytes: float) -> float:
            rows = batch * row_bytes
            return inside * rows / self.hw.nvlink_bytes_per_second + across * rows / self.hw.network_bytes_per_second

        return moe_layers(self.config) * (one_way(hidden * BF16 + k * (8 + 4)) + one_way(hidden * BF16))

    def prefill_seconds(self, prompt_tokens: float) -> float:
        """A forward of the prompt: prompt x F(prompt / 2) FLOPs (causal) plus its all-to-all."""
        f0, slope, flops_per_second, _, _, a2a_seconds_per_token = self._rates
        return causal_flops(f0, slope, prompt_tokens) / flops_per_second + prompt_tokens * a2a_seconds_per_token

    @functools.cached_property
    def _rates(self) -> tuple[float, ...]:
        """What every step reads (the plan asks millions of times): F(0), dF/dc, a decode step's FLOP/s (Hardware.
        decode_flops: the training efficiency unless --decode-flops-share),
        decode's HBM bytes/s, a decode step's all-to-all latency, a prefilled token's all-to-all seconds."""
        f0, slope = flop_coefficients(self.config)
        return (
            f0,
            slope,
            self.hw.decode_flops(self.routed_format),
            self.hw.hbm_bytes_per_second * self.hw.decode_bandwidth_efficiency,
            moe_layers(self.config) * self.hw.decode_a2a_seconds(self.expert_parallel),
            a2a_seconds_per_token(self.config, self.hw, self.expert_parallel),
        )


def decode_attention_flops_per_token(config: dict, latent: bool) -> float:
    """FLOPs a decode step spends per cached token, every layer. In latent space (absorbed MLA: the query [q_nope W_UK ;
    q_rope] against [c_s ; k_rope_s], then the weights against c_s) 2 H (kv_lora_rank + d_rope) + 2 H kv_lora_rank;
    on expanded keys and values 2 H (d_nope + d_rope + d_v), the count `forward_flops_per_token` holds.
    DeepSeek-V3: 61 x 278,528 = 17.0 MFLOP latent against 61 x 81,920 = 5.0 MFLOP expanded."""
    heads, rank, rope = config["num_attention_heads"], config["kv_lora_rank"], config["qk_rope_head_dim"]
    if latent:
        per_layer = 2 * heads * (rank + rope) + 2 * heads * rank
    else:
        per_layer = 2 * heads * (config["qk_nope_head_dim"] + rope + config["v_head_dim"])
    return float(config["num_hidden_layers"] * per_layer)


def generation_timeline(
    lengths,
    prompt_tokens: int,
    kv_capacity_tokens: int,
    cost: DecodeCost,
    max_sequences: int = 1024,
    headroom: int = ADMISSION_HEADROOM_TOKENS,
):
    """When each of one GPU's sequences (response `lengths`, prompts of `prompt_tokens`) finishes generating under
    continuous batching with `kv_capacity_tokens` of KV cache, as vLLM schedules it: sequences are admitted first
    come first served while their context fits, the cache fills as they grow, and when it is full the latest admitted
    is preempted, goes back to the front of the queue (admission leaves `headroom` tokens per running sequence free:
    vLLM's block of 16 tokens, the torch engine's page of 64, so a preempted sequence is not readmitted at once) and
    on readmission recomputes its context (a prefill of its prompt and the tokens it had). Event-driven: between two events (a finish, a full cache, an admission) the batch
    is fixed and a decode step costs `cost.decode_step_seconds` at the interval's mean context. A fixed-shape step
    (`cost.fixed_shapes`, the torch engine's CUDA graphs: allsync.engines.slots.FixedShapeStep) steps every slot of its
    pool, P = min(max_sequences, sequences), free ones included, and each slot reads the span the longest live row
    needs, bucketed as the engine buckets it (allsync.engines.slots.span_bucket, at most the prompt and the longest
    response), or with the latent kernel (`cost.own_positions`) its own positions, a free slot one:
        step(n live rows, longest live context m) = cost.decode_step_seconds(P, P x span_bucket(m))
                                                    cost.decode_step_seconds(P, live context + P - n)   (own positions)
    (the engine's pool under expert-parallel lockstep is rollout.decode_batch slots of the ranks' longest capacity;
    the plan takes this GPU's). Returns the finish seconds per sequence, in input order."""
    lengths = np.asarray(lengths, dtype=np.int64)
    if lengths.size and int(lengths.max()) + prompt_tokens > kv_capacity_tokens:
        raise ValueError(
            f"a sequence of {int(lengths.max()) + prompt_tokens:,} tokens does not fit a KV cache of {kv_capacity_tokens:,}"
        )
    # Every running sequence advances one token a decode step, so each is tracked by the decode-step count at which it
    # ends (`ends`, a heap; a preempted sequence's entry is dropped when it comes up): O(log n) an event.
    length = lengths.tolist()
    finish = np.zeros(len(length))
    done = [0] * len(length)
    queue, active = collections.deque(range(len(length))), []
    running = [False] * len(length)
    ends: list[tuple[int, int]] = []  # (decode step at which the sequence ends, sequence)
    start = [0] * len(length)  # the decode step at which it would have begun: ends - length
    now, used, clock = 0.0, 0, 0
    pool = min(max_sequences, len(length))
    capacity = prompt_tokens + max(length, default=0)

    def step_seconds(n: int, steps: int) -> float:
        """One decode step's seconds in the interval of `steps` steps from `clock` with the `n` rows of `active`."""
        if not cost.fixed_shapes:
            return cost.decode_step_seconds(n, used + n * steps / 2)
        if cost.own_positions:
            return cost.decode_step_seconds(pool, used + n * steps / 2 + pool - n)
        longest = prompt_tokens + clock - min(start[i] for i in active) + 1 + steps // 2
        return cost.decode_step_seconds(pool, pool * span_bucket(longest, capacity))

    def live(entry: tuple[int, int]) -> bool:
        """The entry is its sequence's current one (not left by a preemption)."""
        end, i = entry
        return running[i] and end == start[i] + length[i]

    while queue or active:
        while (
            queue
            and len(active) < max_sequences
            and used + prompt_tokens + done[queue[0]] + (len(active) + 1) * headroom <= kv_capacity_tokens
        ):
            i = queue.popleft()
            active.append(i)
            running[i] = True
            start[i] = clock - done[i]
            heapq.heappush(ends, (start[i] + length[i], i))
            used += prompt_tokens + done[i]
            now += cost.prefill_seconds(prompt_tokens + done[i])
        while not live(ends[0]):  # preempted since it was pushed
            heapq.heappop(ends)
        n = len(active)
        steps = min(ends[0][0] - clock, (kv_capacity_tokens - used) // n)
        if steps == 0:  # the cache is full: preempt the latest admitted
            j = active.pop()
            running[j] = False
            done[j] = clock - start[j]
            used -= prompt_tokens + done[j]
            queue.appendleft(j)
            continue
        now += steps * step_seconds(n, steps)
        clock += steps
        used += n * steps
        while ends and (ends[0][0] == clock or not live(ends[0])):
            entry = heapq.heappop(ends)
            if live(entry):
                i = entry[1]
                running[i] = False
                finish[i] = now
                active.remove(i)
                used -= prompt_tokens + length[i]
    return finish
