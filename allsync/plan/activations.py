"""Training activations: what the trainer's forward saves for backward, per token, traced from the real code.

`trace_saved_bytes` builds a two-layer model with the checkpoint's per-token shapes (one dense decoder layer, one MoE
layer whose experts are the top-k a token is routed to, so every expert row a token makes exists) with the run's
LoRA, runs the trainer's own forward (allsync.update.forward.forward_pass) on T = 32 and 64 tokens under
`torch.autograd.graph.saved_tensors_hooks`, and counts the distinct storages saved in each layer that are not weights.
The slope over T is the bytes per token, the rest a per-layer constant. Attention is counted as a fused GPU kernel
(flash / memory-efficient) saves it: q, k, v, the output and a float32 log-sum-exp per head and token; the CPU's
math kernel would also keep heads x T^2 probabilities. The frozen format does not change it (traced: bf16 and NF4
experts save the same bytes), so the trace runs on bf16 weights.

The peak above the resident model during one forward + backward of `tokens` tokens:

    activation checkpointing tokens x (L x h x b + post) + tokens x max(dense, moe) + max(const)
                             (each layer's input kept, one layer recomputed at a time)
    without                  tokens x (n_dense x dense + n_moe x moe + post) + n_dense x const_dense + n_moe x const_moe

with h the hidden size, b the compute dtype's bytes, `post` what follows the layers (the final norm and the chunked
lm_head's input). Not counted: the constant part of experts beyond the top-k the trace holds (their LoRA factors
cast to the compute dtype, a few hundred kB each; 1.3% of a tiny model's saved bytes, tests/allsync/test_plan_fit.py),
and transient buffers of the backward (activation gradients). Checked against the real-size layers measured on an H200
(BENCHMARKS.md).
"""

from __future__ import annotations

import collections
import hashlib
import json
import os
import tempfile
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from allsync.plan.shapes import tiny_spec_fields

TRACE_TOKENS = (32, 64)
TRACE_VERSION = 3  # bump when the trainer's forward changes what it saves, so that cached traces are redone
SHAPE_KEYS = (
    "num_experts_per_tok",
    "hidden_size",
    "intermediate_size",
    "moe_intermediate_size",
    "num_attention_heads",
    "q_lora_rank",
    "kv_lora_rank",
    "qk_rope_head_dim",
    "qk_nope_head_dim",
    "v_head_dim",
)


@dataclass(frozen=True)
class SavedBytes:
    """Bytes saved for backward by the trainer's forward: per token of a dense and of a MoE decoder layer, per token
    after the layers (`post`), a layer's input per token (what activation checkpointing keeps), and each layer's
    constant part (LoRA factors cast to the compute dtype and the like)."""

    dense: float
    moe: float
    post: float
    layer_input: float
    dense_const: float
    moe_const: float

    def peak(self, config: dict, tokens: int, checkpointing: bool, offload: bool = False) -> int:
        """Bytes above the resident model during one forward + backward of `tokens` tokens (module docstring).
        offload (optim.activation_offload): what the forward saves waits in host memory, and backward brings back
        one part at a time: the lm_head's input, then each layer's (with checkpointing: its input, while the layer
        is recomputed)."""
        layers = config["num_hidden_layers"]
        n_dense = min(config.get("first_k_dense_replace", 0), layers)
        n_moe = layers - n_dense
        if offload:
            layer = max(self.dense, self.moe) + (self.layer_input if checkpointing else 0.0)
            return round(tokens * max(self.post, layer) + max(self.dense_const, self.moe_const))
        if checkpointing:
            per_token = layers * self.layer_input + self.post + max(self.dense, self.moe)
            return round(tokens * per_token + max(self.dense_const, self.moe_const))
        per_token = n_dense * self.dense + n_moe * self.moe + self.post
        return round(tokens * per_token + n_dense * self.dense_const + n_moe * self.moe_const)

    def dispatched(self, one_row: SavedBytes, rows: float) -> SavedBytes:
        """This single-rank trace's bytes when the MoE layer sends each token to `rows` ranks (allsync.plan.step_time.
        expected_places: those holding its experts), from `one_row`, the expert-parallel trace over one rank (one row
        per token): the MoE layer's per-token bytes moe + rows x (one_row.moe - moe)."""
        return replace(one_row, moe=self.moe + rows * (one_row.moe - self.moe))

    def offloaded(self, config: dict, tokens: int, checkpointing: bool) -> int:
        """Host bytes activation offload holds for one forward + backward: every tensor the forward saves."""
        layers = config["num_hidden_layers"]
        n_dense = min(config.get("first_k_dense_replace", 0), layers)
        if checkpointing:
            return round(tokens * (layers * self.layer_input + self.post))
        return round(tokens * (n_dense * self.dense + (layers - n_dense) * self.moe + self.post))


def trace_spec(config: dict):
    """The two-layer moe_lora.tiny.TinySpec with `config`'s per-token shapes: one dense and one MoE layer, as many
    experts as a token is routed to (all of them chosen), one expert group."""
    from moe_lora.tiny import TinySpec

    top_k = config["num_experts_per_tok"]
    return TinySpec(**tiny_spec_fields(config, 2, 1, top_k, n_group=1, topk_group=1))


class _FusedAttention(torch.autograd.Function):
    """Stands in for a fused attention kernel while tracing: its output computed without a graph, and what such a
    kernel saves for backward (q, k, v, the output, a float32 log-sum-exp per head and token)."""

    @staticmethod
    def forward(ctx, q, k, v, out):
        lse = torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)
        ctx.save_for_backward(q, k, v, out, lse)
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad):
        return None, None, None, grad


@contextmanager
def fused_attention():
    """torch's scaled_dot_product_attention, inside, saves what a fused GPU kernel saves (`_FusedAttention`)."""
    original = torch.nn.functional.scaled_dot_product_attention

    def attention(q, k, v, *args, **kwargs):
        with torch.no_grad():
            out = original(q, k, v, *args, **kwargs)
        return _FusedAttention.apply(q, k, v, out)

    torch.nn.functional.scaled_dot_product_attention = attention
    try:
        yield
    finally:
        torch.nn.functional.scaled_dot_product_attention = original


def weight_storages(model) -> set[int]:
    """Storages of the model's parameters, buffers and the tensors its modules hold (frozen weights, scales)."""
    found = {t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers())}
    for module in model.modules():
        for value in vars(module).values():
            values = (
                value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else [value]
            )
            for item in values:
                for t in item if isinstance(item, (list, tuple)) else [item]:
                    if isinstance(t, torch.Tensor):
                        found.add(t.untyped_storage().data_ptr())
    return found


@contextmanager
def one_rank_expert_dispatch(model):
    """Every routed-expert module of `model` sends its tokens through moe_lora.expert_parallel.ExpertDispatch over a
    one-rank gloo group: the expert-parallel path and what it saves for backward for one dispatched row per token
    (SavedBytes.dispatched scales it to the rows a layout's tokens make), without a second process. The module's own
    experts are the whole group's."""
    from datetime import timedelta

    import torch.distributed as dist

    from moe_lora.expert_parallel import ExpertDispatch, ExpertLayout, hops_of
    from quant.modules import FrozenExperts

    group = dist.ProcessGroupGloo(dist.HashStore(), 0, 1, timedelta(seconds=60))
    experts = [m for m in model.modules() if isinstance(m, FrozenExperts)]
    for module in experts:
        hops = hops_of(ExpertLayout(1, 1, module.num_experts), 0, group)
        module.dispatch = ExpertDispatch(group, 1, module.num_experts, hops)
    try:
        yield
    finally:
        for module in experts:
            module.dispatch = None


def saved_per_layer(model, tokens: int, checkpointing: bool, critic: bool = False) -> dict[str, int]:
    """Bytes of the distinct non-weight storages the trainer's forward saves for backward, by where they are saved:
    layer0, layer1, ..., post (after the last layer). critic: `model` is an allsync.update.critic.Critic, whose forward (its
    values) is traced instead of the policy's."""
    from allsync.update.forward import checkpointed_decoder_layers, forward_pass
    from allsync.update.sequences import SequenceBatch

    weights, seen, saved = weight_storages(model), set(), collections.Counter()
    where = ["pre"]
    hooks = [
        layer.register_forward_pre_hook(lambda module, args, i=i: where.__setitem__(0, f"layer{i}"))
        for i, layer in enumerate(model.model.layers)
    ]
    hooks.append(model.model.norm.register_forward_pre_hook(lambda module, args: where.__setitem__(0, "post")))

    held = []  # every storage counted stays alive, so that no later one reuses its address and goes uncounted

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = t.untyped_storage().data_ptr()
        if key not in weights and key not in seen:
            seen.add(key)
            held.append(t)
            saved[where[0]] += t.untyped_storage().nbytes()
        return t

    ids = torch.randint(0, 200, (1, tokens))
    batch = SequenceBatch(ids, torch.ones_like(ids), torch.ones(1, tokens - 1))
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), fused_attention():
            with checkpointed_decoder_layers(model, checkpointing):
                model(batch) if critic else forward_pass(model, batch)
    finally:
        for hook in hooks:
            hook.remove()
    return dict(saved)


def trace_saved_bytes(
    config: dict,
    lora_rank: int,
    targets: tuple[str, ...],
    compute_dtype: str = "bfloat16",
    expert_parallel: bool = False,
    critic: bool = False,
) -> SavedBytes:
    """SavedBytes of the run's LoRA on `config`'s shapes, traced (module docstring). Builds the two-layer checkpoint in
    a temporary directory (DeepSeek-V3's shapes: 2.2 GB, about a minute on 2 cores). expert_parallel: the routed
    tokens go through the expert-parallel dispatch (`one_rank_expert_dispatch`), as every layout with EP > 1 trains.
    critic: the PPO / T-PPO critic's forward (allsync.update.critic.Critic over the policy's frozen weights) instead of the
    policy's."""
    return trace_paths(config, lora_rank, targets, compute_dtype, (expert_parallel,), critic)[expert_parallel]


def trace_paths(
    config: dict,
    lora_rank: int,
    targets: tuple[str, ...],
    compute_dtype: str,
    expert_parallel: tuple[bool, ...],
    critic: bool = False,
) -> dict[bool, SavedBytes]:
    """`trace_saved_bytes` for each expert_parallel path of `expert_parallel`, on one built model (the build is most
    of a trace's time)."""
    from moe_lora.lora import LoRAConfig, attach_lora
    from moe_lora.tiny import make_tiny
    from quant.loader import QuantPlan, load_frozen_model

    dtype = getattr(torch, compute_dtype)
    with tempfile.TemporaryDirectory(prefix="allsync-plan-trace-") as tmp:
        base = make_tiny(Path(tmp) / "model", trace_spec(config))
        model = load_frozen_model(str(base), QuantPlan.uniform("bf16"), compute_dtype=dtype, progress=False)
    attach_lora(model, LoRAConfig(lora_rank, 2 * lora_rank, tuple(targets)))
    if critic:
        from allsync.update.critic import Critic

        model = Critic(model, seed=0)
    out = {}
    for path in expert_parallel:
        with one_rank_expert_dispatch(model) if path else nullcontext():
            first, second = (saved_per_layer(model, t, False, critic) for t in TRACE_TOKENS)
        span = TRACE_TOKENS[1] - TRACE_TOKENS[0]
        slope = {k: (second.get(k, 0) - first.get(k, 0)) / span for k in second}
        const = {k: first.get(k, 0) - TRACE_TOKENS[0] * slope[k] for k in second}
        out[path] = SavedBytes(
            dense=slope["layer0"],
            moe=slope["layer1"],
            post=slope.get("post", 0.0),
            layer_input=config["hidden_size"] * dtype.itemsize,
            dense_const=max(const["layer0"], 0.0),
            moe_const=max(const["layer1"], 0.0),
        )
    return out


def trace_key(config: dict, lora_rank: int, targets: tuple[str, ...], compute_dtype: str, **path: bool) -> str:
    """What the trace depends on, hashed: the per-token shapes, the LoRA, the compute dtype, the path taken
    (trace_saved_bytes' expert_parallel and critic)."""
    shape = {k: config[k] for k in SHAPE_KEYS}
    taken = sorted(name for name, on in path.items() if on)
    text = json.dumps([shape, lora_rank, sorted(targets), compute_dtype, TRACE_VERSION, *taken], sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "allsync" / "plan"


def saved_bytes(
    config: dict, lora_rank: int, targets: tuple[str, ...], compute_dtype: str = "bfloat16", **taken: bool
) -> SavedBytes:
    """`trace_saved_bytes` (taken: the path, its expert_parallel and critic), kept in the user's cache (~/.cache/allsync/plan/, a
    JSON file per shape, rank, targets, dtype and path) so that only the first plan of a shape traces. The
    expert-parallel path is traced with the single-rank one on the same model (`trace_paths`), both kept: its plans
    read both (RunTraces.at)."""
    ep, critic = taken.get("expert_parallel", False), taken.get("critic", False)

    def cached(expert_parallel: bool) -> Path:
        key = trace_key(config, lora_rank, targets, compute_dtype, expert_parallel=expert_parallel, critic=critic)
        return cache_dir() / f"saved-{key}.json"

    if cached(ep).exists():
        return SavedBytes(**json.loads(cached(ep).read_text()))
    paths = (False, True) if ep else (False,)  # the expert-parallel path's plans read the single-rank trace too
    traced = trace_paths(config, lora_rank, targets, compute_dtype, paths, critic)
    for expert_parallel, result in traced.items():
        path = cached(expert_parallel)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(result)) + "\n")
        tmp.replace(path)
    return traced[ep]


@dataclass(frozen=True)
class RunTraces:
    """The traces a run's plans read: the policy's forward, on the expert-parallel path for layouts with EP > 1, and
    the critic's for runs that have one. Each is traced on first use and then read from the user's cache."""

    config: dict
    lora_rank: int
    targets: tuple[str, ...]
    compute_dtype: str = "bfloat16"
    critic: bool = False

    @classmethod
    def of(cls, run, model_config: dict) -> RunTraces:
        r = run
        return cls(model_config, r.lora.rank, tuple(r.lora.targets), r.model.compute_dtype, r.algorithm.uses_critic)

    def activations(self, config: dict, tokens: int, optim, expert_parallel: int) -> tuple[int, int]:
        """(bytes above the resident model for one forward + backward of `tokens` tokens under `optim`'s
        checkpointing and offload, the bytes offload keeps in host memory): the larger of the policy's and the
        critic's (their graphs are alive one at a time)."""
        saved = [t for t in self.at(expert_parallel) if t is not None]
        checkpointing, offload = optim.activation_checkpointing, optim.activation_offload
        peak = max(t.peak(config, tokens, checkpointing, offload) for t in saved)
        offloaded = max(t.offloaded(config, tokens, checkpointing) for t in saved) if offload else 0
        return peak, offloaded

    def at(self, expert_parallel: int) -> tuple[SavedBytes, SavedBytes | None]:
        """(the policy's trace, the critic's or None) for a layout with this expert-parallel size."""
        from allsync.plan.step_time import expected_places

        args = (self.config, self.lora_rank, self.targets, self.compute_dtype)

        def traced(critic: bool) -> SavedBytes:
            if expert_parallel <= 1:
                return saved_bytes(*args, critic=critic)
            one_row = saved_bytes(*args, expert_parallel=True, critic=critic)  # traces (and keeps) both paths
            single = saved_bytes(*args, critic=critic)
            return single.dispatched(one_row, expected_places(self.config, expert_parallel))

        return traced(False), traced(True) if self.critic else None
