"""allsync plan: the activation trace, the two phases of a worker's memory, the verdict and the command's errors."""

import json

import pytest
import torch

from allsync.cli import main
from allsync.plan.command import parse_size
from allsync.plan.activations import saved_per_layer, trace_saved_bytes
from allsync.plan.shapes import DEEPSEEK_V3
from allsync.plan.step_time import expected_places
from allsync.plan.weights import lora_values
from moe_lora.lora import DEFAULT_TARGETS
from moe_lora.lora import LoRAConfig, attach_lora
from moe_lora.tiny import TinySpec, make_tiny
from quant.loader import QuantPlan, load_frozen_model

TARGETS = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "o_proj", "dense_mlp", "shared_experts", "routed_experts")
SPEC = TinySpec(layers=5, dense_layers=2, experts=8, experts_per_token=2)


def test_the_two_layer_trace_gives_a_deeper_models_saved_bytes(tmp_path):
    """The trace's per-token and per-layer numbers, extrapolated to 2 dense + 3 MoE layers, give what that model's
    forward saves for backward at another token count (no checkpointing: the saved tensors are the peak's). Within
    2%: the trace's MoE layer holds the top-k experts (2), this model 8, and the constant part an expert adds
    (its LoRA factors cast to bf16) is not in the trace."""
    base = make_tiny(tmp_path / "m", SPEC)
    config = json.loads((base / "config.json").read_text())
    saved = trace_saved_bytes(config, 8, TARGETS, "bfloat16")
    model = load_frozen_model(str(base), QuantPlan.uniform("bf16"), compute_dtype=torch.bfloat16, progress=False)
    attach_lora(model, LoRAConfig(8, 16, TARGETS))
    measured = sum(saved_per_layer(model, 48, checkpointing=False).values())
    assert saved.peak(config, 48, checkpointing=False) == pytest.approx(measured, rel=0.02)
    kept = sum(saved_per_layer(model, 48, checkpointing=True).values())  # checkpointing keeps each layer's input
    assert kept == 48 * (5 * saved.layer_input + saved.post)
    assert saved.moe > 0 and saved.dense > 0


def test_the_expert_parallel_trace_counts_the_dispatched_rows(tmp_path):
    """On the expert-parallel path (ExpertDispatch over a one-rank gloo group: one dispatched row per token) a MoE
    layer saves, per row, beyond what the single-rank path saves: the row received ([hidden] in the compute dtype),
    its index (int64), which of the token's k assignments it carries (k bools) and their weights (k in the compute
    dtype). Nothing of the outputs sent back. The dense layer and what follows the layers are the same."""
    config = json.loads((make_tiny(tmp_path / "m", SPEC) / "config.json").read_text())
    single = trace_saved_bytes(config, 8, TARGETS, "bfloat16")
    ep = trace_saved_bytes(config, 8, TARGETS, "bfloat16", expert_parallel=True)
    k, hidden = config["num_experts_per_tok"], config["hidden_size"]
    assert ep.moe - single.moe == hidden * 2 + 8 + k + k * 2
    assert (ep.dense, ep.post, ep.layer_input) == (single.dense, single.post, single.layer_input)
    assert single.dispatched(ep, 3.0).moe == single.moe + 3 * (ep.moe - single.moe)


@pytest.mark.slow  # issue 70: whole runs of many seconds go to the slow lane, which CI runs after the default one
@pytest.mark.parametrize(
    "world_size, ep_size", [(2, 2), (4, 4)]
)  # EP 2: 0.995 as EP 4 (BENCHMARKS.md); the slow run keeps it
def test_the_expert_parallel_trace_predicts_what_real_ranks_save(tiny_bf16, world_size, ep_size):
    """The tiny model (8 routed experts, top-2) trained at EP 2 and 4 in real processes (gloo): what each rank's
    forward of 96 tokens saves for backward, summed over the EP group (a rank's share of the dispatched rows depends
    on the routing; the group's total does not), against the expert-parallel trace's prediction per rank x ranks, its
    dispatched rows per token from the routing's expected ranks (allsync.plan.step_time.expected_places): within 5%
    (the plan's CPU rows in BENCHMARKS.md); the single-rank trace undercounts it by more than twice that error."""
    import torch.multiprocessing as mp

    from allsync.launch.group import free_port
    from moe_lora.lora import DEFAULT_TARGETS
    from tests.ep_ranks import run_saved_bytes_rank

    tokens = 96
    config = json.loads((tiny_bf16 / "config.json").read_text())
    with mp.Manager() as manager:
        results = manager.dict()
        address = f"tcp://127.0.0.1:{free_port()}"
        mp.spawn(
            run_saved_bytes_rank,
            args=(world_size, ep_size, address, str(tiny_bf16), tokens, results),
            nprocs=world_size,
        )
        measured = sum(dict(results).values())
    one_row = trace_saved_bytes(config, 4, DEFAULT_TARGETS, "bfloat16", expert_parallel=True)
    single = trace_saved_bytes(config, 4, DEFAULT_TARGETS, "bfloat16")
    ep = single.dispatched(one_row, expected_places(config, ep_size))
    predicted = world_size * ep.peak(config, tokens, checkpointing=False)
    print(f"EP {ep_size}: measured {measured:,} B, predicted {predicted:,} B ({predicted / measured:.3f})")
    assert predicted == pytest.approx(measured, rel=0.05)
    undercount = measured - world_size * single.peak(config, tokens, checkpointing=False)
    assert undercount > 2 * abs(predicted - measured)  # the dispatched rows are more than the prediction's error


def test_the_critic_is_traced_and_counted(trace_cache, tmp_path):
    """PPO / T-PPO: the critic's adapter (every target but the routed experts) and head with gradients and AdamW's
    moments are the trainable tensors allsync.update.critic.Critic really holds, x 4; its forward is traced too, and the
    plan's activations are the larger of the two forwards (their graphs live one at a time)."""
    from allsync.config import parse_config
    from allsync.update.critic import Critic
    from allsync.plan.activations import RunTraces
    from allsync.plan.fit import Layout, plan_run
    from allsync.plan.weights import critic_bytes

    base = make_tiny(tmp_path / "m", SPEC)
    config = json.loads((base / "config.json").read_text())
    run = parse_config(
        {
            "model": {"base": str(base), "compute_dtype": "bfloat16"},
            "lora": {"rank": 8, "alpha": 16, "targets": list(TARGETS)},
            "rollout": {"group_size": 1},
            "producer": {"kind": "windows", "window": 4},
            "algorithm": {"advantage": "egae", "dynamic_sampling": False},
        }
    )
    model = load_frozen_model(str(base), QuantPlan.uniform("bf16"), compute_dtype=torch.bfloat16, progress=False)
    attach_lora(model, LoRAConfig(8, 16, TARGETS))
    critic_model = Critic(model, 0)
    held = sum(t.numel() for t in critic_model.trainable_tensors().values())
    assert critic_bytes(run, config) == {"critic": 4 * held * 4}
    assert critic_bytes(parse_config({"model": {"base": str(base)}}), config) == {}
    critic = trace_saved_bytes(config, 8, TARGETS, "bfloat16", critic=True)
    policy = trace_saved_bytes(config, 8, TARGETS, "bfloat16")
    assert critic != policy and critic.post > policy.post  # its head reads the float32 hidden state
    # the critic's real forward on this deeper model (2 dense + 3 MoE layers, 8 experts) saves what its trace predicts
    measured = sum(saved_per_layer(critic_model, 48, checkpointing=False, critic=True).values())
    assert critic.peak(config, 48, checkpointing=False) == pytest.approx(measured, rel=0.02)
    traces = RunTraces.of(run, config)
    assert traces.critic and traces.at(1)[1] == critic
    plan = plan_run(run, config, Layout(1, 1, 10**10), traces)
    tokens = plan.tokens_per_forward
    assert plan.per_gpu_bytes["critic"] == 4 * held * 4
    assert plan.per_gpu_bytes["activations"] == max(t.peak(config, tokens, False) for t in (policy, critic))


def test_sizes_are_parsed_or_refused_naming_the_flag():
    assert parse_size("80GB", "--gpu-memory") == 80e9 and parse_size("141GiB", "--gpu-memory") == 141 * 2**30
    assert parse_size("25GB/s", "--host-link", per_second=True) == 25e9
    with pytest.raises(ValueError, match="--gpu-memory 'eighty'"):
        parse_size("eighty", "--gpu-memory")
    with pytest.raises(ValueError, match="--host-link '25GB': give a rate"):
        parse_size("25GB", "--host-link", per_second=True)
    with pytest.raises(ValueError, match=r"--host-link '0GB/s': give a positive rate such as 25GB/s"):  # not a size
        parse_size("0GB/s", "--host-link", per_second=True)


def test_an_empty_config_is_refused_and_a_plan_that_does_not_fit_exits_1(trace_cache, tmp_path, capsys):
    """An empty YAML would plan the defaults (no run of the user's): refused, exit 2. A layout that does not fit exits
    1, so that a script can tell (before: 0); one that fits, 0."""
    empty = tmp_path / "empty.yaml"
    empty.write_text("# nothing yet\n")
    assert main(["plan", "--config", str(empty), "--shape", "deepseek-v3"]) == 2
    assert f"{empty}: the config is empty" in capsys.readouterr().err
    config = "recipes/configs/dapo_math_deepseek_v3_671b.yaml"
    args = ["plan", "--config", config, "--shape", "deepseek-v3", "--colocation", "sleep", "--draws", "1"]
    assert main(args) == 1 and "verdict: does not fit" in capsys.readouterr().out
    assert main([*args, "--margin", "0.05"]) == 0 and "verdict: fits" in capsys.readouterr().out


def test_kv_settings_past_the_room_are_priced_at_the_room(trace_cache, tmp_path, capsys):
    """rollout.kv_cache_tokens past what the generate phase leaves is priced at the room's whole pages, and says so
    (before: "if it fit", faster than anything the loop can run); the same for more full-length slots than fit."""
    import yaml

    source = yaml.safe_load(open("recipes/configs/dapo_math_deepseek_v3_671b_torch_engine.yaml"))
    runs = {}
    for name, rollout in (
        ("shipped", {}),
        ("too many tokens", {"kv_cache_tokens": 1_500_000}),
        ("too many slots", {"kv_cache_tokens": None, "decode_batch": 128}),
    ):
        data = {**source, "rollout": {**source["rollout"], **rollout}}
        path, out = tmp_path / f"{len(runs)}.yaml", tmp_path / f"{len(runs)}.json"
        path.write_text(yaml.safe_dump(data))
        code = main(["plan", "--config", str(path), "--shape", "deepseek-v3", "--draws", "1", "--json", str(out)])
        runs[name] = (code, json.loads(out.read_text()))
    assert runs["shipped"][0] == 0 and runs["too many tokens"][0] == runs["too many slots"][0] == 1
    room = runs["shipped"][1]["kv_cache_tokens"] // 64 * 64
    tokens = runs["too many tokens"][1]["schedules"][0]
    assert (
        f"priced at the {room:,} KV tokens there is room for, not rollout.kv_cache_tokens 1,500,000" in tokens["note"]
    )
    assert tokens["step_seconds"] >= runs["shipped"][1]["step_seconds"] * 0.999
    slots = runs["too many slots"][1]["schedules"][0]
    fit = runs["shipped"][1]["sequences_at_once"]
    assert f"priced at the {fit} full-length slots there is room for, not rollout.decode_batch 128" in slots["note"]


@pytest.mark.slow  # issue 70: whole runs of many seconds go to the slow lane, which CI runs after the default one
def test_the_671b_plan_on_48_h100s(trace_cache, tmp_path, capsys):
    config = "recipes/configs/dapo_math_deepseek_v3_671b.yaml"
    out = tmp_path / "plan.json"
    assert (
        main(["plan", "--config", config, "--shape", "deepseek-v3", "--colocation", "sleep", "--json", str(out)]) == 1
    )
    text = capsys.readouterr().out
    plan = json.loads(out.read_text())
    parts = plan["per_gpu_bytes"]
    for key in ("routed_experts", "shared_experts", "attention", "dense_mlp", "embeddings", "lora", "lora_grads"):
        assert parts[key] > 0, key
    assert parts["optimizer"] == 2 * parts["lora"] and parts["engine_weights"] > parts["routed_experts"]
    frozen = sum(parts[k] for k in ("routed_experts", "shared_experts", "attention", "dense_mlp", "embeddings"))
    assert frozen / 1e9 == pytest.approx(41.86, abs=0.01)  # tests/allsync/test_plan.py's 42.07 GB less norms/router
    # activation checkpointing at one 21,504-token sequence, offloaded: the 61 layer inputs and the final part wait in
    # host memory; on the GPU one MoE layer recomputed with its input, on the expert-parallel path (EP 16): about
    # 616 kB per token (a 14.4 kB row per (token, rank holding one of its experts), 5.34 of the 16 ranks for V3's
    # routing) instead of the single rank's 525 kB
    assert plan["tokens_per_forward"] == 21504 and 12.5e9 < parts["activations"] < 14e9
    assert 18e9 < plan["offloaded_activation_bytes"] < 22e9
    # vLLM beside its weights: the absorbed-MLA W_UK / W_UV (bf16), a LoRA slot for every module it adapts (bf16),
    # its buffers (2 GiB); the generate phase also leaves our memory share's 2 GiB free
    assert parts["engine_mla_absorbed"] == 61 * 128 * (128 + 128) * 512 * 2  # 2.05 GB
    experts = range(16)
    assert parts["engine_lora_slot"] == 2 * lora_values(DEEPSEEK_V3, 16, DEFAULT_TARGETS, experts)
    assert parts["engine_buffers"] == 2 * 2**30
    engine = parts["engine_weights"] + parts["engine_mla_absorbed"] + parts["engine_lora_slot"]
    assert plan["host_bytes_per_gpu"] == engine + plan["offloaded_activation_bytes"]  # sleep, training
    assert plan["train_bytes"] == sum(parts.values()) - engine - parts["kv_cache"]  # vLLM asleep: its buffers stay
    frozen_parts = frozen + parts["norms_and_router"]
    one_sequence = 21504 * 61 * 576 * 2
    assert plan["generate_bytes"] == (
        sum(parts.values()) - parts["activations"] - parts["kv_cache"] - frozen_parts + 2 * 2**30 + one_sequence
    )
    # the H100's 81,089 MiB as torch reports it, less the 10% margin: the generate phase does not fit by 0.4 GB
    assert plan["gpu_memory_bytes"] == 81089 * 2**20 and plan["margin_bytes"] == pytest.approx(
        0.1 * 81089 * 2**20, abs=1
    )
    assert plan["train_room_bytes"] > 4e9 and -1e9 < plan["generate_room_bytes"] < 0
    assert not plan["fits"] and "verdict: does not fit: the generate phase with one sequence" in text
    assert plan["train_efficiency_points"]["nf4"] == [[4096, 0.117], [21504, 0.264]] and plan["kept_groups"] == 0.5
    assert plan["layout"] == {
        "gpus": 48,
        "expert_parallel": 16,
        "experts_per_gpu": 16,
        "engine": "vllm",
        "colocation": "sleep",
        "activation_checkpointing": True,
        "activation_offload": True,
        "prompt_tokens": 1024,
        "frozen_formats": "model.quant",
        "margin": 0.1,
    }
    # at a 5% margin it fits
    assert (
        main(["plan", "--config", config, "--shape", "deepseek-v3", "--colocation", "sleep", "--margin", "0.05"]) == 0
    )
    assert "verdict: fits" in capsys.readouterr().out
    assert "parallel.expert_parallel = 16 with rollout.engine vllm" in plan["refused"]  # the loop still refuses it
    assert (
        main(
            [
                "plan",
                "--config",
                config,
                "--shape",
                "deepseek-v3",
                "--gpus",
                "64",
                "--expert-parallel",
                "32",
                "--colocation",
                "sleep",
                "--json",
                str(out),
            ]
        )
        == 2
    )  # 480 prompts do not split over 64 GPUs
    assert "rollout.prompts_per_step = 480 does not split" in capsys.readouterr().err


def test_the_671b_torch_engine_config_is_accepted_and_fits_48_h100s(trace_cache, tmp_path, capsys):
    """The shipped torch-engine variant: the checker accepts it (nothing refused) and the plan fits it with one copy
    of the base, shared-outer expert LoRA (LoRA + gradients + AdamW 3.3 GB), room for 34 rows of 21,504 tokens of FP8
    MLA latent inside the 10% margin, which 128 KV slots share in pages (rollout.kv_cache_tokens), and the step its
    header states (with the engine's decode as measured on an H200)."""
    config = "recipes/configs/dapo_math_deepseek_v3_671b_torch_engine.yaml"
    out = tmp_path / "plan.json"
    assert main(["plan", "--config", config, "--shape", "deepseek-v3", "--json", str(out)]) == 0
    plan = json.loads(out.read_text())
    parts = plan["per_gpu_bytes"]
    assert plan["fits"] and plan["refused"] is None and plan["layout"]["engine"] == "torch"
    assert parts["engine_weights"] == parts["engine_mla_absorbed"] == parts["engine_lora_slot"] == 0
    assert (parts["lora"] + parts["lora_grads"] + parts["optimizer"]) / 1e9 == pytest.approx(3.28, abs=0.01)
    # the graphed step's bf16 stacks of one MoE layer's 16 held experts, generation's only: 1.41 GB
    assert parts["decode_graph_experts"] == 16 * 3 * 7168 * 2048 * 2
    assert plan["train_bytes"] / 1e9 == pytest.approx(58.60, abs=0.01)
    assert plan["sequences_at_once"] == 34  # rows at full length, FP8 (rollout.kv_cache_dtype)
    # its decode steps graphed (rollout.decode_graphs) with the latent attention kernel, as measured on an H200
    # (2026-11-28, allsync.plan.torch_decode.GRAPHED_H200: 1.63-2.02x the roofline of its weights with each quantized
    # one's bf16 copy, 10.9x that of each slot's own FP8 latent positions), 128 rows sharing 743,744 tokens in pages,
    # dynamic sampling's rounds streamed through the slots: 6.18 h, the mean of 5 draws of the step's lengths and kept
    # groups (5.46-6.77 h); training 4,132 s (an old-logprob forward: the FP8 cache samples with other numbers than
    # the trainer's, so algorithm.old_logprobs is recompute; the all-to-all a row per (token, rank holding one of its
    # experts), once per node across); the graphed step's exchange an all-gather of every rank's rows
    assert plan["step_seconds"] / 3600 == pytest.approx(6.18, abs=0.01)
    main_step = plan["schedules"][0]
    assert main_step["schedule"] == "all-sync" and "as measured on an H200" in main_step["note"]
    assert "own positions" in main_step["note"] and len(main_step["step_seconds_per_draw"]) == 5
    assert [round(s / 3600, 2) for s in main_step["step_seconds_per_draw"]][0] == 5.46
    assert main_step["parts"]["train"] == pytest.approx(4132, abs=1)
    # with the FP8 linears as FP8 GEMMs (rollout.fp8_linear_kernel scaled_mm; assumed: their bf16 copies' cost, as
    # measured in the dequantizing step, taken off): 5.63 h, left off for the sampler mismatch it brings
    gemm = plan["schedules"][1]
    assert gemm["schedule"] == "all-sync with rollout.fp8_linear_kernel scaled_mm"
    assert gemm["step_seconds"] / 3600 == pytest.approx(5.63, abs=0.01) and "by FP8 GEMMs" in gemm["note"]
    assert gemm["parts"]["train"] == pytest.approx(4132, abs=1)
    # and with the NF4 experts read by their kernel too (rollout.frozen_expert_kernel triton, measured: 11.3-17.5x the
    # roofline of reading them once): 10.89 h, slower, so the config leaves it off
    experts = plan["schedules"][2]
    assert experts["schedule"].endswith("and rollout.frozen_expert_kernel triton")
    assert experts["step_seconds"] / 3600 == pytest.approx(10.89, abs=0.01) and "stored bytes once" in experts["note"]
    # the decode FLOPs are priced at the training share of the peak (26.4%) unless --decode-flops-share says otherwise;
    # as measured the graphed steps are far from compute-bound: at half the peak the same config is 6.11 h
    assert plan["decode_flops_share"] is None
    half = ["--decode-flops-share", "0.5", "--json", str(out)]
    assert main(["plan", "--config", config, "--shape", "deepseek-v3", *half]) == 0
    faster = json.loads(out.read_text())
    assert faster["decode_flops_share"] == 0.5
    assert faster["step_seconds"] / 3600 == pytest.approx(6.11, abs=0.01)
    assert "decode FLOPs at 50% of the peak" in capsys.readouterr().out


@pytest.mark.parametrize(
    "args, message",
    [
        (["--gpus", "40"], r"--gpus 40 / --expert-parallel 16 \(parallel.expert_parallel\)"),
        (["--expert-parallel", "3", "--gpus", "48"], r"the expert-parallel size must divide"),
        (["--gpu-memory", "lots"], r"--gpu-memory 'lots'"),
    ],
)
def test_a_layout_or_size_the_plan_cannot_use_is_refused_naming_the_flag(trace_cache, args, message, capsys):
    config = "recipes/configs/dapo_math_deepseek_v3_671b.yaml"
    assert main(["plan", "--config", config, "--shape", "deepseek-v3", *args]) == 2
    assert __import__("re").search(message, capsys.readouterr().err)


def test_a_base_not_on_this_machine_needs_a_shape(capsys):
    config = "recipes/configs/dapo_math_deepseek_v3_671b.yaml"
    assert main(["plan", "--config", config]) == 2
    assert "model.base = '/checkpoints/DeepSeek-V3' has no config.json here: name its shape with --shape" in (
        capsys.readouterr().err
    )
