"""`allsync plan`: the memory of a config's layout, its estimated step time, and with --search every layout that
fits, fastest first. Flags that cannot be parsed or used are refused, naming the flag, before anything is computed."""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

SIZE_UNITS = {
    "": 1,
    "B": 1,
    "KB": 1e3,
    "MB": 1e6,
    "GB": 1e9,
    "TB": 1e12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}


def parse_size(text: str, flag: str, per_second: bool = False) -> float:
    """ "80GB" / "141GiB" (or "25GB/s" with per_second) in bytes; a ValueError naming the flag otherwise."""
    body = text.strip().upper()
    if per_second:
        if not body.endswith("/S"):
            raise ValueError(f"{flag} {text!r}: give a rate such as 25GB/s")
        body = body[:-2]
    match = re.fullmatch(r"([0-9]*\.?[0-9]+)\s*([KMGT]I?B|B)?", body)
    if match is None or float(match.group(1)) <= 0:
        example = "a positive rate such as 25GB/s" if per_second else "a positive size such as 80GB or 141GiB"
        raise ValueError(f"{flag} {text!r}: give {example}")
    return float(match.group(1)) * SIZE_UNITS[match.group(2) or ""]


def parse_interconnect(text: str) -> dict[str, float]:
    """`--interconnect nvlink=153GB/s,network=43GB/s`: per-GPU all-to-all bandwidths inside and across nodes."""
    try:
        given = dict(item.split("=", 1) for item in text.split(","))
    except ValueError as e:
        raise ValueError(f"--interconnect {text!r}: expected nvlink=RATE,network=RATE") from e
    unknown = set(given) - {"nvlink", "network"}
    if unknown:
        raise ValueError(f"--interconnect {text!r}: unknown link {sorted(unknown)[0]!r} (nvlink, network)")
    return {f"{k}_bytes_per_second": parse_size(v, f"--interconnect {k}", per_second=True) for k, v in given.items()}


def add_plan_parser(sub: argparse._SubParsersAction) -> None:
    from allsync.plan.fit import COLOCATIONS, DEFAULT_MARGIN
    from allsync.plan.hardware import GPUS
    from allsync.plan.lengths import DEFAULT_LENGTHS
    from allsync.plan.shapes import SHAPES

    p = sub.add_parser(
        "plan", help="will a config fit its GPUs, how long a step takes, and (--search) which layout is fastest"
    )
    p.add_argument("--config", required=True, help="a run config (YAML)")
    p.add_argument("--gpus", type=int, help="GPUs (default: the config's parallel.nodes x workers_per_node)")
    p.add_argument("--expert-parallel", type=int, help="routed experts over this many GPUs (default: the config's)")
    p.add_argument(
        "--gpu", choices=sorted(GPUS), default="h100", help="the GPU's rates and memory (default %(default)s)"
    )
    p.add_argument("--gpu-memory", help="memory of one GPU, e.g. 80GB (default: the --gpu's)")
    p.add_argument(
        "--shape", choices=sorted(SHAPES), help="the model's shape by name when model.base is not on this machine"
    )
    p.add_argument("--colocation", choices=COLOCATIONS, default="resident", help="vLLM's weights while training")
    p.add_argument("--prompt-tokens", type=int, default=1024, help="prompt length, in tokens (default %(default)s)")
    p.add_argument(
        "--response-lengths", default=DEFAULT_LENGTHS, help="a file of lengths, or %(default)s (the default, assumed)"
    )
    p.add_argument("--prompts-per-step", type=int, help="plan this batch instead of rollout.prompts_per_step")
    p.add_argument(
        "--kept-groups",
        type=float,
        help=f"share of generated groups dynamic sampling keeps (default {ASSUMED_KEPT} with algorithm.dynamic_sampling, "
        "assumed; 1 without)",
    )
    p.add_argument(
        "--conversations",
        type=int,
        help="conversations per episode of a multi-conversation producer (ceil(document / producer.chunk_tokens) + 1;"
        " required for one); --prompt-tokens is then each conversation's prompt",
    )
    p.add_argument("--gpus-per-node", type=int, default=8, help="GPUs joined by NVLink (default %(default)s)")
    p.add_argument(
        "--interconnect",
        metavar="nvlink=RATE,network=RATE",
        help="per-GPU all-to-all rates, e.g. nvlink=153GB/s,network=43GB/s (default)",
    )
    p.add_argument("--host-link", metavar="RATE", help="GPU-host rate for sleep mode, e.g. 25GB/s (default)")
    p.add_argument("--host-memory", default="2TB", help="host memory of one node (default %(default)s)")
    p.add_argument(
        "--decode-flops-share",
        type=float,
        help="share of the peak a decode step's FLOPs run at (assumed; default: the training share measured on an "
        "H200, until a GPU measures the decode kernels)",
    )
    p.add_argument(
        "--vllm-decode-factor",
        type=float,
        help="vLLM's decode step over the plan's roofline (default: the slowest of the published DeepSeek-V3 runs "
        "that state their batch and context, allsync/plan/vllm_decode.py)",
    )
    p.add_argument(
        "--expert-lora-share",
        type=float,
        help="share of no-LoRA decode vLLM keeps with LoRA on the routed experts (default 0.62, SGLang's Triton "
        "MoE-LoRA backend; its fast path reaches 0.78-0.89)",
    )
    p.add_argument(
        "--margin",
        type=float,
        default=DEFAULT_MARGIN,
        help="share of each GPU's memory a plan leaves unused (default %(default)s: CUDA context, NCCL, fragmentation)",
    )
    p.add_argument(
        "--turns",
        type=int,
        help="replies per episode of a tool agent (default producer.max_turns, the most); each reply's row grows by "
        "the reply and an observation of producer.max_observation_tokens",
    )
    p.add_argument(
        "--draws",
        type=int,
        default=5,
        help="draws of one step's response lengths and kept groups; the step is their mean, printed with their range "
        "(default %(default)s; --search ranks layouts on the first draw)",
    )
    p.add_argument("--search", action="store_true", help="rank every layout that fits on --gpus by step time")
    p.add_argument("--json", help="write the plan here too")
    p.set_defaults(run=run_plan)


ASSUMED_KEPT = 0.5  # DAPO-style runs keep about half their groups once the policy solves some prompts every time


def kept_share(run, given: float | None) -> float:
    """--kept-groups, or its default: ASSUMED_KEPT with algorithm.dynamic_sampling, 1 without. ValueError naming the
    flag when it is outside (0, 1] or below 1 for a run that keeps every group."""
    if given is None:
        return ASSUMED_KEPT if run.algorithm.dynamic_sampling else 1.0
    if not 0 < given <= 1:
        raise ValueError(f"--kept-groups {given}: must be in (0, 1]")
    if given < 1 and not run.algorithm.dynamic_sampling:
        raise ValueError(f"--kept-groups {given}: the config has no algorithm.dynamic_sampling, so every group is kept")
    return given


def conversations_of(run, given: int | None) -> int:
    """--conversations: required (>= 2) for a multi-conversation producer, refused for any other."""
    multiconv = run.producer.kind == "multiconv"
    if given is None:
        if multiconv:
            raise ValueError(
                "producer.kind multiconv: give --conversations N, the conversations of an episode "
                "(ceil(document tokens / producer.chunk_tokens) + 1), and --prompt-tokens, each one's prompt"
            )
        return 1
    if not multiconv:
        raise ValueError(
            f"--conversations {given}: only for producer.kind multiconv (this config's is {run.producer.kind})"
        )
    if given < 2:
        raise ValueError(f"--conversations {given}: a multi-conversation episode has at least 2 (memory, answer)")
    return given


def turns_of(run, given: int | None) -> int:
    """--turns: for a tool agent (default producer.max_turns), refused for any other producer."""
    agent = run.producer.kind == "agent"
    if given is None:
        return run.producer.max_turns if agent else 1
    if not agent:
        raise ValueError(f"--turns {given}: only for producer.kind agent (this config's is {run.producer.kind})")
    if not 1 <= given <= run.producer.max_turns:
        raise ValueError(f"--turns {given}: must be in [1, producer.max_turns = {run.producer.max_turns}]")
    return given


def hardware_of(args: argparse.Namespace):
    from dataclasses import replace

    from allsync.plan.hardware import hardware

    memory = int(parse_size(args.gpu_memory, "--gpu-memory")) if args.gpu_memory else None
    host = parse_size(args.host_link, "--host-link", per_second=True) if args.host_link else None
    hw = hardware(args.gpu, memory, host)
    if args.gpus_per_node < 1:
        raise ValueError(f"--gpus-per-node {args.gpus_per_node}: must be >= 1")
    links = parse_interconnect(args.interconnect) if args.interconnect else {}
    share = args.decode_flops_share
    if share is not None and not 0 < share <= 1:
        raise ValueError(f"--decode-flops-share {share}: a share of the peak, in (0, 1]")
    if args.vllm_decode_factor is not None and args.vllm_decode_factor <= 0:
        raise ValueError(f"--vllm-decode-factor {args.vllm_decode_factor}: must be > 0")
    lora_share = args.expert_lora_share
    if lora_share is not None and not 0 < lora_share <= 1:
        raise ValueError(f"--expert-lora-share {lora_share}: a share of no-LoRA decode, in (0, 1]")
    return replace(
        hw,
        gpus_per_node=args.gpus_per_node,
        decode_flops_share=share,
        vllm_decode_factor=args.vllm_decode_factor,
        expert_lora_decode_share=lora_share,
        **links,
    )


def model_config_of(run, shape: str | None) -> dict:
    from allsync.plan.shapes import SHAPES
    from quant.checkpoint_io import read_config

    if shape:
        return SHAPES[shape]
    if (Path(run.model.base) / "config.json").exists():
        return read_config(run.model.base)
    raise ValueError(f"model.base = {run.model.base!r} has no config.json here: name its shape with --shape")


def run_plan(args: argparse.Namespace) -> int:
    """Print (and with --json write) the plan; the exit code says whether it fits: 0, or 1 when it does not."""
    from dataclasses import replace

    from allsync.config import load_config_for_planning
    from allsync.plan.activations import RunTraces
    from allsync.plan.estimate import colocated_steps
    from allsync.plan.generation import Workload
    from allsync.plan.fit import Layout, format_plan, plan_run
    from allsync.plan.hardware import TRAIN_EFFICIENCY_POINTS
    from allsync.plan.lengths import parse_lengths
    from allsync.plan.schedules import mean_over_draws
    from allsync.plan.search import format_search, search
    from allsync.plan.vllm_decode import vllm_step_factor

    run, refusal = load_config_for_planning(args.config)
    if args.prompts_per_step is not None:
        if args.prompts_per_step < 1:
            raise ValueError(f"--prompts-per-step {args.prompts_per_step}: must be >= 1")
        run = replace(run, rollout=replace(run.rollout, prompts_per_step=args.prompts_per_step))
    model_config = model_config_of(run, args.shape)
    gpus = args.gpus if args.gpus is not None else run.parallel.workers
    ep = args.expert_parallel if args.expert_parallel is not None else run.parallel.expert_parallel
    experts = model_config["n_routed_experts"]
    for value, name in (
        (gpus, "--gpus" if args.gpus is not None else "parallel.nodes x workers_per_node"),
        (ep, "--expert-parallel" if args.expert_parallel is not None else "parallel.expert_parallel"),
    ):
        if value < 1:
            raise ValueError(f"{name} {value}: must be >= 1")
    if gpus % ep or experts % ep:
        raise ValueError(
            f"--gpus {gpus} / --expert-parallel {ep} (parallel.expert_parallel): the expert-parallel size must divide "
            f"the GPUs and the {experts} routed experts"
        )
    if run.rollout.prompts_per_step % gpus:
        raise ValueError(
            f"--gpus {gpus}: rollout.prompts_per_step = {run.rollout.prompts_per_step} does not split over the GPUs "
            "(--prompts-per-step plans another batch)"
        )
    if args.prompt_tokens < 1:
        raise ValueError(f"--prompt-tokens {args.prompt_tokens}: must be >= 1")
    context = model_config.get("max_position_embeddings")
    if context and args.prompt_tokens + run.rollout.max_new_tokens > context:
        raise ValueError(
            f"--prompt-tokens {args.prompt_tokens} + rollout.max_new_tokens {run.rollout.max_new_tokens} = "
            f"{args.prompt_tokens + run.rollout.max_new_tokens:,} tokens exceed the model's context "
            f"(max_position_embeddings {context:,})"
        )
    kept_groups = kept_share(run, args.kept_groups)
    conversations = conversations_of(run, args.conversations)
    turns = turns_of(run, args.turns)
    observation = run.producer.max_observation_tokens if turns > 1 else 0
    row_tokens = args.prompt_tokens + turns * run.rollout.max_new_tokens + (turns - 1) * observation
    if context and row_tokens > context:
        raise ValueError(
            f"--turns {turns}: an agent row of --prompt-tokens + {turns} x rollout.max_new_tokens + {turns - 1} x "
            f"producer.max_observation_tokens = {row_tokens:,} tokens exceeds the model's context ({context:,})"
        )
    if not 0 <= args.margin < 1:
        raise ValueError(f"--margin {args.margin}: must be in [0, 1)")
    if args.draws < 1:
        raise ValueError(f"--draws {args.draws}: must be >= 1")
    hw = hardware_of(args)
    work = Workload(
        parse_lengths(args.response_lengths),
        args.prompt_tokens,
        kept_groups,
        conversations=conversations,
        turns=turns,
        observation_tokens=observation,
    )
    layout = Layout(
        gpus,
        ep,
        hw.memory_bytes,
        args.colocation,
        args.prompt_tokens,
        hw.host_link_bytes_per_second,
        int(parse_size(args.host_memory, "--host-memory")),
        hw.gpus_per_node,
        args.margin,
        row_tokens if turns > 1 else None,
    )

    print("tracing the trainer's saved activations for this shape (cached after the first time) ...", flush=True)
    traces = RunTraces.of(run, model_config)
    plan = plan_run(run, model_config, layout, traces)
    print(format_plan(plan))
    out = {**plan.to_json(), "refused": str(refusal) if refusal else None, "hardware": hw.name}
    out["decode_flops_share"] = hw.decode_flops_share  # None: the training share
    out["vllm_step_factor"] = vllm_step_factor(hw, "routed_experts" in run.lora.targets)  # over the roofline
    out["response_lengths"] = work.lengths.description
    out["kept_groups"], out["conversations"], out["turns"] = work.kept_groups, work.conversations, work.turns
    out["train_efficiency_points"] = {  # (tokens per forward, share of the peak), measured (hardware.py)
        fmt: [list(point) for point in points] for fmt, points in TRAIN_EFFICIENCY_POINTS.items()
    }
    if plan.kv_cache_tokens >= plan.sequence_tokens:
        draws = [colocated_steps(run, model_config, layout, plan, hw, replace(work, seed=d)) for d in range(args.draws)]
        steps = mean_over_draws(draws)
        print(format_steps(steps, work, hw, plan.fits, run))
        out["step_seconds"] = steps[0].seconds
        out["schedules"] = [s.to_json() for s in steps]
    else:
        print("step time: not estimated (the engine has no room for one sequence)")
        out["step_seconds"] = None
    if refusal is not None:
        print(f"the config checker refuses this config: {refusal}")
    if args.search:
        ranked, refused = search(run, model_config, hw, gpus, traces, work, layout)
        print(format_search(ranked, refused, gpus))
        out["search"] = [c.to_json() for c in ranked]
        out["search_refused"] = [{"layout": label, "reason": why} for label, why in refused]
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    return 0 if plan.fits else 1


def format_steps(steps, work, hw, fits: bool, run=None) -> str:
    """The estimated step time of the planned layout, per schedule that applies to it (`run`: vLLM's decode factor
    said where it generates)."""
    head = "estimated step time" + ("" if fits else " (if it fit)")
    lines = [f"{head} on {hw.name} GPUs, responses {work.lengths.description}, prompts {work.prompt_tokens:,} tokens:"]
    if hw.decode_flops_share is None:
        lines.append("  (decode FLOPs at the training share of the peak, measured on an H200; --decode-flops-share)")
    else:
        lines.append(f"  (decode FLOPs at {hw.decode_flops_share:.0%} of the peak: --decode-flops-share, assumed)")
    if run is not None and run.rollout.engine == "vllm":
        lines.append(vllm_factor_line(hw, "routed_experts" in run.lora.targets))
    for s in steps:
        built = ("" if s.built else ", modelled, not built") + (f" ({s.note})" if s.note else "")
        parts = ", ".join(f"{k} {v:,.0f} s" for k, v in s.parts.items() if v >= 0.5)
        spread = ""
        if s.per_draw is not None and len(s.per_draw) > 1:
            low, high = min(s.per_draw) / 3600, max(s.per_draw) / 3600
            spread = f" (mean of {len(s.per_draw)} draws: {low:.2f}-{high:.2f} h)"
        lines.append(
            f"  {s.schedule}{built}: {s.seconds:,.0f} s = {s.seconds / 3600:.2f} h{spread}, {s.idle_fraction:.0%} of "
            f"GPU time idle ({parts})"
        )
    return "\n".join(lines)


def vllm_factor_line(hw, routed_expert_lora: bool) -> str:
    """How the plan prices vLLM's decode step (allsync/plan/vllm_decode.py)."""
    from allsync.plan.vllm_decode import factor_and_share, vllm_step_factor

    factor, share = factor_and_share(hw)
    source = "--vllm-decode-factor" if hw.vllm_decode_factor is not None else "published DeepSeek-V3 runs"
    step = vllm_step_factor(hw, routed_expert_lora)
    line = f"  (vLLM's decode step at {step:.2f}x the roofline: {factor:.2f} ({source})"
    if routed_expert_lora:
        line += f" over {share:.2f}, the share of no-LoRA decode expert LoRA keeps (--expert-lora-share)"
    return line + ")"
