"""The `allsync` command.

allsync make-tiny OUT [--layers N --experts E --dense-layers K --fp8 --seed S ...]
allsync load CKPT [--routed-experts nf4 --attention fp8 ...] [--prompt TEXT]
allsync export SRC --base CKPT --out DIR --format peft|merged [--dtype bf16|fp8]
               [--merge-into checkpoint|trained --routed-experts nf4 ...]
allsync eval SRC|none --base CKPT --data FILE --out DIR [--engine torch|vllm] [--n 32] [--temperature 1.0]
             [--top-p 0.7] [--max-new-tokens N] [--reward math_dapo] [--template dapo_math]
allsync health RUN_DIR [--replay similarity|threshold] [--png PATH]
allsync check-vllm ADAPTER --base CKPT [--expert-parallel N]
allsync plan --config X [--gpus N] [--expert-parallel K] [--gpu h100|h200] [--gpu-memory 80GB] [--shape deepseek-v3]
             [--colocation resident|sleep|shared] [--prompt-tokens N] [--response-lengths FILE|lognormal:median=M,sigma=S]
             [--prompts-per-step N] [--kept-groups F] [--gpus-per-node 8] [--interconnect nvlink=153GB/s,network=43GB/s] [--host-link 25GB/s] [--host-memory 2TB]
             [--search] [--json FILE]
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import fields

from allsync.plan.command import add_plan_parser


def _add_make_tiny(sub: argparse._SubParsersAction) -> None:
    from moe_lora.tiny import TinySpec

    p = sub.add_parser("make-tiny", help="write a tiny DeepSeek-V3 checkpoint in the real on-disk format")
    p.add_argument("out", help="output directory (must not exist or be empty, unless --overwrite)")
    defaults = TinySpec()
    for f in fields(TinySpec):
        flag = "--" + f.name.replace("_", "-")
        if f.type in ("bool", bool):
            p.add_argument(flag, action="store_true", help=f"(default {getattr(defaults, f.name)})")
        else:
            said = TinySpec.DEFAULTS_SAID.get(f.name, "%(default)s")
            p.add_argument(flag, type=int, default=getattr(defaults, f.name), help=f"(default {said})")
    p.add_argument("--overwrite", action="store_true", help="replace OUT once the new checkpoint is complete")
    p.set_defaults(run=_run_make_tiny)


def _run_make_tiny(args: argparse.Namespace) -> None:
    from moe_lora.tiny import TinySpec, make_tiny

    spec = TinySpec(**{f.name: getattr(args, f.name) for f in fields(TinySpec)})
    path = make_tiny(args.out, spec, overwrite=args.overwrite)
    print(f"wrote {path} ({'fp8' if spec.fp8 else 'bf16'}, {spec.layers} layers, {spec.experts} experts)")


def _add_quant_flags(p: argparse.ArgumentParser) -> None:
    from quant.formats import FORMATS
    from quant.layout import QUANTIZABLE_GROUPS
    from quant.loader import QuantPlan

    for group in QUANTIZABLE_GROUPS:
        p.add_argument(
            "--" + group.replace("_", "-"),
            default=getattr(QuantPlan(), group),
            choices=FORMATS,
            help=f"frozen format of {group} (default %(default)s)",
        )
    p.add_argument("--double-quant", action="store_true", help="nf4: quantize the absmax statistics too")


def _quant_plan(args: argparse.Namespace):
    from quant.layout import QUANTIZABLE_GROUPS
    from quant.loader import QuantPlan

    return QuantPlan(**{g: getattr(args, g) for g in QUANTIZABLE_GROUPS}, double_quant=args.double_quant)


def _add_load(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "load", help="load a checkpoint frozen and quantized; print its byte report and a greedy completion"
    )
    p.add_argument("checkpoint")
    _add_quant_flags(p)
    p.add_argument("--prompt", default="what is 12+30?", help="user message for the greedy completion")
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.set_defaults(run=_run_load)


def _run_load(args: argparse.Namespace) -> None:
    from quant.loader import byte_report, format_byte_report, load_frozen_model

    model = load_frozen_model(args.checkpoint, _quant_plan(args))
    print(format_byte_report(byte_report(model)))
    print(f"greedy completion: {greedy_completion(model, args.checkpoint, args.prompt, args.max_new_tokens)!r}")


def greedy_completion(model, checkpoint: str, prompt: str, max_new_tokens: int) -> str:
    """Chat-format the prompt with the checkpoint's tokenizer and decode greedily."""
    import torch
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )["input_ids"]
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)
    return tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)


def _add_export(sub: argparse._SubParsersAction) -> None:
    from quant.formats import FORMATS
    from quant.layout import QUANTIZABLE_GROUPS
    from quant.loader import QuantPlan

    p = sub.add_parser("export", help="export a trained adapter as a PEFT/vLLM adapter or a merged checkpoint")
    p.add_argument("src", help="a training checkpoint (with adapter/) or a PEFT adapter directory")
    p.add_argument("--base", required=True, help="the base checkpoint the adapter was trained on")
    p.add_argument("--out", required=True, help="output directory (must not exist or be empty, unless --overwrite)")
    p.add_argument("--format", required=True, choices=("peft", "merged"))
    p.add_argument("--dtype", default="bf16", choices=("bf16", "fp8"), help="merged only: bf16 or FP8 128x128 blocks")
    p.add_argument(
        "--merge-into",
        default="checkpoint",
        choices=("checkpoint", "trained"),
        help="merged only: fold s*B*A into each adapted weight as the base checkpoint stores it (checkpoint, the "
        "default: the full-precision base plus the adapter), or into that weight quantized to the format it was "
        "trained in and dequantized (trained: exactly the weights the trained model used; give those formats "
        "with the flags below, as in the run's model.quant)",
    )
    for group in QUANTIZABLE_GROUPS:
        p.add_argument(
            "--" + group.replace("_", "-"),
            choices=FORMATS,
            help=f"--merge-into trained: the format the {group} weights were trained in (default {getattr(QuantPlan(), group)}, as in `allsync load`)",
        )
    p.add_argument("--double-quant", action="store_true", help="--merge-into trained: nf4 was double-quantized")
    p.add_argument(
        "--compact",
        action="store_true",
        help="peft only, for a lora.expert_layout shared_outer adapter: each shared factor once a layer (allsync's "
        "own form, read back by allsync; PEFT and vLLM load the default per-expert form)",
    )
    p.add_argument("--overwrite", action="store_true")
    p.set_defaults(run=_run_export)


def trained_plan_of(args: argparse.Namespace):
    """The QuantPlan to merge into (None: the checkpoint's stored weights); format flags need --merge-into trained."""
    from quant.layout import QUANTIZABLE_GROUPS
    from quant.loader import QuantPlan

    named = {g: getattr(args, g) for g in QUANTIZABLE_GROUPS if getattr(args, g) is not None}
    if args.format != "merged" or args.merge_into != "trained":
        given = [f"--{g.replace('_', '-')}" for g in named] + (["--double-quant"] if args.double_quant else [])
        if given:
            raise ValueError(
                f"{', '.join(given)}: training formats apply only with --format merged --merge-into trained"
            )
        return None
    return QuantPlan(**named, double_quant=args.double_quant)


def _run_export(args: argparse.Namespace) -> None:
    from moe_lora.adapter_io import export_merged, export_peft, read_adapter
    from quant.checkpoint_io import read_config

    plan = trained_plan_of(args)
    adapter = read_adapter(args.src, read_config(args.base))
    if args.compact and args.format != "peft":
        raise ValueError("--compact: only --format peft has a compact form")
    if args.format == "peft":
        out = export_peft(adapter, args.base, args.out, overwrite=args.overwrite, compact=args.compact)
        into = ""
    else:
        out = export_merged(adapter, args.base, args.out, dtype=args.dtype, trained_plan=plan, overwrite=args.overwrite)
        into = (
            " merged into the base's stored weights"
            if plan is None
            else f" merged into the weights as trained ({_plan_text(plan)})"
        )
    print(f"wrote {args.format} export of {len(adapter.modules())} adapted modules (rank {adapter.r}){into} to {out}")


def _plan_text(plan) -> str:
    from quant.layout import QUANTIZABLE_GROUPS

    text = ", ".join(f"{g} {plan.format_of(g)}" for g in QUANTIZABLE_GROUPS)
    return text + (", double-quantized nf4" if plan.double_quant else "")


def _add_eval(sub: argparse._SubParsersAction) -> None:
    from allsync.run.evaluation import EvalArgs

    d = EvalArgs("", "", "", "")
    p = sub.add_parser(
        "eval", help="sample n responses per problem of a data file, score them, write samples, summary and plot"
    )
    p.add_argument("src", help="a training checkpoint, a PEFT adapter directory, or none (the base alone)")
    p.add_argument("--base", required=True, help="the base checkpoint")
    p.add_argument("--data", required=True, help="parquet / JSONL / JSON rows (verl's layout or {prompt, answer})")
    p.add_argument("--out", required=True, help="writes samples.jsonl, summary.json and eval.png here")
    p.add_argument(
        "--engine",
        default=d.engine,
        choices=("torch", "vllm"),
        help="torch: our frozen base with the adapter attached; vllm: the adapter served by vLLM (default %(default)s)",
    )
    p.add_argument("--n", type=int, default=d.n, help="samples per problem (default %(default)s)")
    p.add_argument("--temperature", type=float, default=d.temperature, help="0 is greedy (default %(default)s)")
    p.add_argument("--top-p", type=float, default=d.top_p, help="(default %(default)s, DAPO's AIME setting)")
    p.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens, help="(default %(default)s)")
    p.add_argument(
        "--reward", default=d.reward, help="math_dapo | math_verify | exact | arithmetic (default %(default)s)"
    )
    p.add_argument(
        "--reward-timeout-s", type=float, default=d.reward_timeout_s, help="per sample (default %(default)s)"
    )
    p.add_argument(
        "--on-error", default=d.on_error, choices=("fail", "wrong"), help="a reward that raises or times out"
    )
    p.add_argument("--template", default=None, help="dapo_math, or a text with {problem}, for plain string prompts")
    p.add_argument(
        "--batch-problems", type=int, default=d.batch_problems, help="problems per generate call (default %(default)s)"
    )
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--compute-dtype", default=d.compute_dtype, choices=("float32", "bfloat16"))
    p.add_argument(
        "--device", default=d.device, choices=("auto", "cpu", "cuda"), help="torch engine (default %(default)s)"
    )
    p.add_argument("--overwrite", action="store_true", help="write into a non-empty --out")
    _add_quant_flags(p)  # the torch engine's frozen formats: give the run's model.quant
    p.set_defaults(run=_run_eval)


def _run_eval(args: argparse.Namespace) -> None:
    from allsync.run.evaluation import EvalArgs, evaluate_cli

    given = {f.name: getattr(args, f.name) for f in fields(EvalArgs) if f.name != "plan"}
    evaluate_cli(EvalArgs(**given, plan=_quant_plan(args)))


def _add_health(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "health", help="report a run's workers and alarms (workers.jsonl, health.jsonl) and draw their timeline"
    )
    p.add_argument("run_dir", help="a run's out_dir")
    p.add_argument(
        "--replay",
        choices=("similarity", "threshold"),
        help="replay this detector (default settings) instead of reading the alarms the run raised",
    )
    p.add_argument("--png", help="where to draw the timeline (default RUN_DIR/health.png)")
    p.set_defaults(run=_run_health)


def _run_health(args: argparse.Namespace) -> None:
    from pathlib import Path

    from allsync.health.detector import DETECTORS, health_report, plot_health

    report, alarms = health_report(args.run_dir, DETECTORS[args.replay]() if args.replay else None)
    png = plot_health(args.run_dir, alarms, args.png or Path(args.run_dir) / "health.png")
    print(report)
    print(f"timeline: {png}")


def _add_check_vllm(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "check-vllm",
        help="load a PEFT adapter through vLLM's own LoRA loader (routed experts included, no engine) and compare",
    )
    p.add_argument("adapter", help="a PEFT adapter directory (allsync export --format peft) or a training checkpoint")
    p.add_argument("--base", required=True, help="the base checkpoint")
    p.add_argument(
        "--expert-parallel", type=int, default=1, help="check every rank of this expert-parallel size (default 1)"
    )
    p.set_defaults(run=_run_check_vllm)


def _run_check_vllm(args: argparse.Namespace) -> None:
    from allsync.engines.vllm_lora_check import VLLMRefused, check_adapter

    try:
        report = check_adapter(args.adapter, args.base, args.expert_parallel)
    except VLLMRefused as exc:
        print(f"vLLM refused: {exc}")
        raise SystemExit(1) from exc
    print(report.summary())


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="allsync", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    _add_make_tiny(sub)
    _add_load(sub)
    _add_export(sub)
    _add_eval(sub)
    _add_health(sub)
    _add_check_vllm(sub)
    add_plan_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        code = args.run(args)  # a command's own exit code (`allsync plan`: 1 when the layout does not fit), or None
    except (ValueError, FileExistsError, FileNotFoundError) as exc:
        print(f"allsync {args.command}: error: {exc}", file=sys.stderr)
        return 2
    return code or 0


if __name__ == "__main__":
    sys.exit(main())
