"""The rules that span sections (engine and export, algorithm and rollout, task and reward, the batch split,
this machine) and the ones that need the checkpoint's config.json."""

from __future__ import annotations


from allsync.producers.registry import producer_classes
from allsync.tasks import TASKS
from allsync.config.errors import ConfigError
from allsync.config.model import LoRASection
from allsync.config.run_config import RunConfig


VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
# model.quant's groups whose frozen weights multiply through quant.formats.frozen_linear (rollout.fp8_linear_kernel)
FP8_LINEAR_GROUPS = ("attention", "shared_experts", "dense_mlp")


def check_decode_graphs(c: RunConfig, fail) -> None:
    """rollout.decode_graphs: CUDA graphs of the torch engine's fixed-shape decode step need a GPU and bfloat16 (torch's
    CUDA grouped_mm, which the fixed-shape experts use)."""
    import torch

    from moe_lora.grouped_gemm import grouped_mm_available, grouped_mm_supported

    if c.parallel.device == "cpu":
        fail("rollout.decode_graphs with parallel.device cpu: CUDA graphs need a GPU")
    if c.model.compute_dtype != "bfloat16":
        fail(
            f"rollout.decode_graphs with model.compute_dtype {c.model.compute_dtype}: the fixed-shape experts run on "
            "torch's CUDA grouped_mm, which takes bfloat16"
        )
    if not grouped_mm_available() or not grouped_mm_supported(torch.bfloat16, c.lora.rank):
        fail(
            f"rollout.decode_graphs with lora.rank {c.lora.rank}: the fixed-shape experts' grouped_mm needs torch.nn."
            "functional.grouped_mm and rank x 2 bytes a multiple of 16 (rank % 8 == 0)"
        )


def check_expert_kernel(lora: LoRASection, compute_dtype: str, device: str, fail) -> None:
    """lora.expert_kernel names a kernel that can run this adapter (grouped_mm: torch has it, the rank's
    strides are 16-byte aligned in the compute dtype, and on GPUs the compute dtype is bfloat16, the one
    torch's CUDA grouped_mm takes)."""
    import torch

    from moe_lora.grouped_gemm import grouped_mm_available, grouped_mm_supported
    from moe_lora.lora_layers import LoRAExperts

    kernel = lora.expert_kernel
    if kernel not in LoRAExperts.kernels:
        fail(f"lora.expert_kernel = {kernel!r}: use {', '.join(LoRAExperts.kernels)}")
    if kernel != "grouped_mm":
        return
    if not grouped_mm_available():
        fail(
            f"lora.expert_kernel = grouped_mm: torch {torch.__version__} has no torch.nn.functional.grouped_mm (use loop or auto)"
        )
    if not grouped_mm_supported(getattr(torch, compute_dtype), lora.rank):
        fail(
            f"lora.expert_kernel = grouped_mm with lora.rank {lora.rank} in model.compute_dtype {compute_dtype}: grouped_mm "
            "needs rank x element size to be a multiple of 16 bytes (rank % 8 == 0 in bfloat16, % 4 in float32)"
        )
    if device == "cuda" and compute_dtype != "bfloat16":
        fail(
            f"lora.expert_kernel = grouped_mm with model.compute_dtype {compute_dtype} on cuda: torch's CUDA grouped_mm "
            "takes bfloat16 (use bfloat16, or the loop kernel)"
        )


def check_this_machine(c: RunConfig, fail) -> None:
    """What this machine must have for a config that is valid in itself (checked last, so that a config's own
    mistakes are named first even on a machine that could not run it)."""
    import torch

    if c.parallel.device == "cuda" and not torch.cuda.is_available():
        fail("parallel.device = cuda: no GPU is visible to torch on this machine (use cpu or auto)")
    if c.rollout.decode_graphs and not torch.cuda.is_available():
        fail("rollout.decode_graphs: no GPU is visible to torch on this machine (CUDA graphs need one)")
    if "triton" in (c.rollout.attention_kernel, c.rollout.frozen_expert_kernel):
        check_triton(c, fail)
    if c.rollout.fp8_linear_kernel == "scaled_mm" and c.parallel.resolved_device() == "cuda":
        from quant.formats import block_scaled_fp8_gemm_on

        if not block_scaled_fp8_gemm_on():
            capability = torch.cuda.get_device_capability()
            fail(
                f"rollout.fp8_linear_kernel scaled_mm: this GPU (compute capability {capability[0]}.{capability[1]}) "
                f"or torch {torch.__version__} has no FP8 GEMM with block scales (needs 8.9+ and "
                "torch.nn.functional.scaled_mm's BlockWise128x128); keep dequantize"
            )


def check_triton(c: RunConfig, fail) -> None:
    """rollout.attention_kernel / frozen_expert_kernel triton: Triton imports, and runs on a GPU or in its interpreter
    (TRITON_INTERPRET=1)."""
    from quant.fused_experts import interpreted

    keys = [k for k in ("attention_kernel", "frozen_expert_kernel") if getattr(c.rollout, k) == "triton"]
    named = " and ".join(f"rollout.{k}" for k in keys)
    try:
        import triton  # noqa: F401
    except ImportError:
        fail(f"{named} triton: Triton is not installed (pip install triton)")
    device = c.parallel.resolved_device()
    if device != "cuda" and not interpreted():
        fail(
            f"{named} triton with parallel.device {device}: the kernel runs on a GPU (or in Triton's interpreter with "
            "TRITON_INTERPRET=1, slowly)"
        )


def check_across_sections(c: RunConfig, fail) -> None:
    """The rules that span sections."""
    from allsync.health.faults import parse_faults

    check_expert_kernel(c.lora, c.model.compute_dtype, c.parallel.resolved_device(), fail)
    check_engine_and_export(c, fail)
    if c.task.needs_producer not in (None, c.producer.kind):
        fail(f"task.name {c.task.name} needs producer.kind {c.task.needs_producer} ({c.task.needs_producer_because})")
    c.producer.check_with(c, fail)
    check_loss_aggregation(c, fail)
    check_algorithm_with_rollout(c, fail)
    check_batch_split(c, fail)
    check_task_with_reward(c, fail)
    try:
        parse_faults(c.health.faults, c.parallel.workers)
    except (ValueError, TypeError) as exc:
        fail(str(exc))


def check_engine_and_export(c: RunConfig, fail) -> None:
    """What vLLM serves (the exported adapter, the rollout engine) and where the sharded experts can generate."""
    if c.run.export == "peft":  # the export at the end must not fail after the whole run
        if c.lora.rank not in VLLM_LORA_RANKS:
            fail(
                f"lora.rank = {c.lora.rank} with run.export peft: vLLM serves only ranks {VLLM_LORA_RANKS} (or set run.export: merged)"
            )
        if "kv_b_proj" in c.lora.targets:
            fail(
                "lora.targets has kv_b_proj with run.export peft: vLLM ignores LoRA on kv_b_proj (or set run.export: merged)"
            )
    if c.rollout.engine == "vllm":
        if c.lora.rank not in VLLM_LORA_RANKS:
            fail(f"lora.rank = {c.lora.rank} with rollout.engine vllm: vLLM accepts only {VLLM_LORA_RANKS}")
        if "kv_b_proj" in c.lora.targets:
            fail("lora.targets has kv_b_proj with rollout.engine vllm: vLLM never applies LoRA on kv_b_proj")
    if c.rollout.decode_graphs:
        check_decode_graphs(c, fail)
    if c.rollout.frozen_expert_kernel == "triton":
        quant = c.model.quant
        if quant.plan().format_of("routed_experts") != "nf4" or quant.double_quant:
            fail(
                f"rollout.frozen_expert_kernel triton with model.quant.routed_experts "
                f"{quant.plan().format_of('routed_experts')}"
                + (" and double_quant" if quant.double_quant else "")
                + ": the kernel reads NF4 experts without double quantization"
            )
    if c.rollout.fp8_linear_kernel == "scaled_mm":
        plan = c.model.quant.plan(c.rollout.engine_formats)
        if not any(plan.format_of(group) == "fp8" for group in FP8_LINEAR_GROUPS):
            keys = "rollout.engine_formats / model.quant" if c.rollout.engine_formats else "model.quant"
            fail(
                f"rollout.fp8_linear_kernel scaled_mm: the engine holds none of {', '.join(FP8_LINEAR_GROUPS)} in fp8 "
                f"({keys}), so no linear would multiply in FP8; set one of them to fp8 or keep dequantize"
            )
    if c.rollout.merge_lora and not c.model.compute_copy:
        fail(
            "rollout.merge_lora without model.compute_copy: W + s B A is formed from the dequantized copy; set "
            "model.compute_copy: true (small models) or rollout.merge_lora: false"
        )
    if c.rollout.engine_formats and (c.rollout.engine != "torch" or c.parallel.expert_parallel > 1):
        fail(
            f"rollout.engine_formats with rollout.engine {c.rollout.engine} and parallel.expert_parallel "
            f"{c.parallel.expert_parallel}: the second frozen copy is the torch engine's, without expert parallelism "
            "(vLLM serves the checkpoint as stored)"
        )
    if c.parallel.expert_parallel > 1 and c.rollout.engine == "vllm" and not c.rollout.engine_expert_parallel:
        fail(
            f"parallel.expert_parallel = {c.parallel.expert_parallel} with rollout.engine vllm and no "
            "rollout.engine_expert_parallel: each worker's own engine would need every expert's LoRA, and a worker "
            "trains only its block; set rollout.engine_expert_parallel: true (the engine's experts sharded too; "
            "`allsync plan` says whether vLLM's copy of the base fits beside the trainer's)"
        )
    if c.rollout.engine_expert_parallel:
        p = c.parallel
        if p.workers < 2 or p.layout != "colocated":
            fail(
                f"rollout.engine_expert_parallel with {p.workers} worker(s) and parallel.layout {p.layout}: the engine "
                "spans the colocated workers; use 2 or more colocated workers"
            )
        if p.workers % c.rollout.engine_tensor_parallel:
            fail(
                f"rollout.engine_tensor_parallel = {c.rollout.engine_tensor_parallel} does not divide the {p.workers} "
                "workers (the engine's data parallelism is workers / engine_tensor_parallel)"
            )


def check_algorithm_with_rollout(c: RunConfig, fail) -> None:
    """Group baselines need groups; a critic needs colocated workers and no group rewards (what each producer
    needs of the algorithm, its settings' check_with says)."""
    from allsync.algorithms import estimators_that

    a, r = c.algorithm, c.rollout
    if a.estimator.needs_groups and r.group_size < 2:
        fail(f"rollout.group_size = {r.group_size} with algorithm.advantage {a.advantage}: a group needs >= 2 samples")
    if a.dynamic_sampling and not a.estimator.needs_groups:
        fail(
            f"algorithm.dynamic_sampling with algorithm.advantage {a.advantage}: dynamic sampling filters "
            f"groups for group baselines ({estimators_that(needs_groups=True)}); set it to false for the critic's "
            "advantages"
        )
    if a.uses_critic and c.optim.value_lr == 0:
        fail(
            f"optim.value_lr = 0 with algorithm.advantage {a.advantage}: the critic would never learn, and its "
            "advantages would stay those of its starting values; give it a learning rate > 0"
        )
    if a.uses_critic and c.parallel.layout != "colocated":
        fail(
            f"parallel.layout {c.parallel.layout} with algorithm.advantage {a.advantage}: the critic's "
            "in-flight responses live on colocated workers; use parallel.layout colocated"
        )
    if a.routing_replay and r.engine != "torch":
        fail(
            f"algorithm.routing_replay with rollout.engine {r.engine}: the torch engine records the experts it routes "
            "each token to; vLLM 0.32 returns them (enable_return_routed_experts) only with its Model Runner V2 "
            "(VLLM_USE_V2_MODEL_RUNNER=1, Triton on a GPU), which is not wired in yet (use rollout.engine torch)"
        )
    if a.old_logprobs == "engine" and r.engine != "torch":
        fail(
            f"algorithm.old_logprobs engine with rollout.engine {r.engine}: only the torch engine samples from the "
            "trainer's own model; vLLM's logprobs come from its own copy and kernels (keep recompute, and algorithm.tis "
            "for the mismatch)"
        )
    if a.old_logprobs == "engine" and (unlike := sampler_unlike_trainer(r)):
        fail(
            f"algorithm.old_logprobs engine with {unlike}: the engine's logprobs are then another policy's numbers, so "
            "the PPO ratio would be taken against the sampler and the clip would act on the mismatch (keep "
            "algorithm.old_logprobs recompute, and algorithm.tis for the mismatch)"
        )
    if a.sampling_rounds == "streamed" and r.engine != "torch":
        fail(
            f"algorithm.sampling_rounds streamed with rollout.engine {r.engine}: rounds stream through the torch "
            "engine's KV slots (vLLM's generate takes one batch at a time; use sequential)"
        )
    if a.sampling_rounds == "streamed" and not c.producer.streams_rounds:
        fail(
            f"algorithm.sampling_rounds streamed with producer.kind {c.producer.kind}: only groups of one generate call "
            f"per episode stream so far (producer.kind {producers_that('streams_rounds')}; use sequential)"
        )
    if a.routing_replay and not c.producer.carries_routing:
        fail(
            f"algorithm.routing_replay with producer.kind {c.producer.kind}: only one-segment episodes carry the "
            f"engine's experts to the trainer so far (use producer.kind {producers_that('carries_routing')})"
        )
    if a.overlong is not None and a.overlong.max_len > r.max_new_tokens:
        fail(f"algorithm.overlong.max_len = {a.overlong.max_len} exceeds rollout.max_new_tokens = {r.max_new_tokens}")
    if c.reward.length is not None and not a.estimator.needs_groups:
        fail(
            f"reward.length with algorithm.advantage {a.advantage}: the length reward compares the responses "
            "of a group, and T-PPO's windows finish responses one by one, not in groups"
        )


def sampler_unlike_trainer(rollout) -> str:
    """The torch engine's settings under which it samples with other numbers than the trainer's forward computes
    (its own frozen copy, an FP8 KV cache, FP8 GEMMs), as `key value` joined by "and"; "" when it is the trainer."""
    keys = []
    if rollout.engine_formats:
        keys.append(f"rollout.engine_formats {rollout.engine_formats}")
    if rollout.kv_cache_dtype != "auto":
        keys.append(f"rollout.kv_cache_dtype {rollout.kv_cache_dtype}")
    if rollout.fp8_linear_kernel != "dequantize":
        keys.append(f"rollout.fp8_linear_kernel {rollout.fp8_linear_kernel}")
    return " and ".join(keys)


def producers_that(attribute: str) -> str:
    """The registered producers whose settings class has `attribute` true, for a refusal's hint (never a hand list)."""
    return " or ".join(kind for kind, cls in producer_classes().items() if getattr(cls, attribute))


def check_loss_aggregation(c: RunConfig, fail) -> None:
    """The policy loss takes the aggregation the run gives it (PolicyLossEntry.aggregations)."""
    from allsync.algorithms import get

    loss = get("policy_loss", c.algorithm.policy_loss)
    agg = c.producer.loss_aggregation(c.algorithm.loss_agg)
    if loss.aggregations is not None and agg not in loss.aggregations:
        fail(
            f"algorithm.policy_loss {c.algorithm.policy_loss} with the aggregation {agg} (algorithm.loss_agg, or the "
            f"producer's weighting): the loss is defined for {' or '.join(loss.aggregations)}"
        )


def check_batch_split(c: RunConfig, fail) -> None:
    """The batch divides over the data-parallel workers and each worker's share over the minibatches."""
    p = c.parallel
    data_parallel = p.workers // p.tensor_parallel  # experts are sharded over EP ranks, tokens still over every rank
    if c.rollout.prompts_per_step % data_parallel:
        fail(
            f"rollout.prompts_per_step = {c.rollout.prompts_per_step} must divide evenly over the {data_parallel} data-parallel workers"
        )
    per_worker = c.rollout.prompts_per_step // data_parallel * c.rollout.group_size
    if per_worker % c.optim.minibatches:
        fail(
            f"optim.minibatches = {c.optim.minibatches} must divide each worker's samples per step (rollout.prompts_per_step "
            f"/ {data_parallel} workers x rollout.group_size = {per_worker})"
        )


def check_task_with_reward(c: RunConfig, fail) -> None:
    """A reward that reads one task's own metadata (TaskDefaults.reward_needs_task) scores that task only, and that
    task scores with it (or a reward.function); the warm start needs a task with a teacher."""
    t, rw = c.task, c.reward
    if rw.function is None:
        owner = next(
            (name for name, cls in TASKS.items() if cls.reward_needs_task and cls.default_reward == rw.name), None
        )
        if (owner is not None and owner != t.name) or (t.reward_needs_task and rw.name != t.default_reward):
            fail(
                f"reward.name = {rw.name!r} with task.name = {t.name!r}: task {owner or t.name} scores with its own "
                f"reward (reward.name: {TASKS[owner or t.name].default_reward}), which reads that task's metadata"
            )
    if c.model.warm_start and not t.has_teacher:
        fail(
            f"model.warm_start with task.name {t.name}: the warm start supervises a task's teacher replies, and this "
            f"task has none (tasks with one: {', '.join(n for n, cls in TASKS.items() if cls.has_teacher)}); give a "
            "model.base that exists and set model.warm_start: false"
        )


def config_with_model_checks(config: RunConfig, model_config: dict, source: str) -> None:
    """Checks that need the base checkpoint's config.json (expert counts against the parallel layout, what this
    machine's vLLM can run on it)."""
    if config.rollout.engine == "vllm":
        from allsync.engines.vllm_engine import unsupported_here

        if (reason := unsupported_here(model_config)) is not None:
            raise ConfigError(f"{source}: rollout.engine vllm with model.base {config.model.base}: {reason}")
        from allsync.engines.vllm_support import triton_lora_kernels

        linear = [t for t in config.lora.targets if t != "routed_experts"]
        if linear and config.model.compute_dtype == "float32" and triton_lora_kernels():
            raise ConfigError(
                f"{source}: lora.targets {linear} with model.compute_dtype float32 and rollout.engine vllm: vLLM's "
                "Triton LoRA kernels for linear layers take float16 / bfloat16 only (its routed experts' take "
                "float32); use compute_dtype bfloat16, or lora.targets [routed_experts]"
            )
    experts = model_config.get("n_routed_experts") or 0
    if config.rollout.engine_expert_parallel:
        from allsync.engines.vllm_engine import has_moe_layers

        heads, tp = model_config.get("num_attention_heads", 1), config.rollout.engine_tensor_parallel
        if heads % tp:
            raise ConfigError(
                f"{source}: rollout.engine_tensor_parallel = {tp} does not divide the {heads} attention heads of "
                f"{config.model.base} (vLLM splits them over the tensor-parallel ranks)"
            )
        if not has_moe_layers(model_config) or experts < config.parallel.workers:
            raise ConfigError(
                f"{source}: rollout.engine_expert_parallel with model.base {config.model.base}: its "
                f"{experts} routed experts must give each of the {config.parallel.workers} workers one at least"
                + ("" if has_moe_layers(model_config) else " (it has no MoE layer)")
            )
    if experts % config.parallel.expert_parallel:
        raise ConfigError(
            f"{source}: parallel.expert_parallel = {config.parallel.expert_parallel} does not divide the "
            f"{experts} routed experts of {config.model.base}"
        )


def check_kv_room(config: RunConfig, model_len: int, source: str) -> None:
    """rollout.kv_cache_tokens admits the longest row the producer builds (model_len positions: prompt and reply):
    its pages of KV_PAGE_TOKENS and the one the engine keeps free (moe_lora.kv_caches.SlotKVCache), else the first
    generate would fail. ConfigError naming the key."""
    from moe_lora.kv_caches import KV_PAGE_TOKENS

    tokens = config.rollout.kv_cache_tokens
    if tokens is None:
        return
    needed = (-(-model_len // KV_PAGE_TOKENS) + 1) * KV_PAGE_TOKENS
    if -(-tokens // KV_PAGE_TOKENS) * KV_PAGE_TOKENS < needed:
        raise ConfigError(
            f"{source}: rollout.kv_cache_tokens = {tokens} cannot admit one row: the longest prompt and "
            f"rollout.max_new_tokens take {model_len} positions, {needed} in pages of {KV_PAGE_TOKENS} with the one "
            f"the engine keeps free; raise it to >= {needed}"
        )


def check_reply_budget(config: RunConfig, tokenizer, problems: list, source: str) -> None:
    """What needs the tokenizer: the task's longest correct reply (TaskSettings.longest_reply) fits in
    rollout.max_new_tokens, and DAPO's overlong window (rewards fall from max_len - cache_len tokens on) starts after
    it, so that no correct reply is cut or penalized for its length. ConfigError naming the keys."""
    tokens, reply = config.task.longest_reply(tokenizer, problems)
    r, overlong = config.rollout, config.algorithm.overlong
    if tokens > r.max_new_tokens:
        raise ConfigError(
            f"{source}: rollout.max_new_tokens = {r.max_new_tokens} with task.name {config.task.name}: its longest "
            f"correct reply is {tokens} tokens with eos ({reply[:60]!r}), which would be cut; raise it to >= {tokens}"
        )
    if overlong is not None and tokens > overlong.max_len - overlong.cache_len:
        raise ConfigError(
            f"{source}: algorithm.overlong.max_len = {overlong.max_len} and cache_len = {overlong.cache_len} with task.name "
            f"{config.task.name}: the shaping penalizes replies past {overlong.max_len - overlong.cache_len} tokens and "
            f"its longest correct reply is {tokens} ({reply[:60]!r}); make max_len - cache_len >= {tokens}"
        )
