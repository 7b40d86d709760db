"""Run by the vLLM tests in a subprocess (vLLM spawns workers, so it needs a __main__ guard).

Usage: python tests/vllm_greedy_check.py CHECKPOINT OUT_JSON [--lora ADAPTER_DIR --max-lora-rank R] [--dtype D]
    [--moe-lora-cpu] [--lora-targets M ...] [--mixed]
Writes vLLM's greedy tokens for fixed prompts, their logprobs, and its teacher-forced logprobs of the prompt tokens;
with --lora the adapter is hot-loaded through a LoRARequest. --moe-lora-cpu runs vLLM's GPU MoE-LoRA path on the
CPU (tests/vllm_moe_lora_cpu.py, activated before vLLM is imported); --mixed also asks for every prompt without the
adapter in the same batch (written under "base").
"""

import argparse
import json
import sys
from pathlib import Path

PROMPTS = ["what is 12+7?", "the cat sat on", "Answer: 42", "compute 3*(4+5) ="]
MAX_TOKENS = 12


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("checkpoint")
    parser.add_argument("out")
    parser.add_argument("--lora")
    parser.add_argument("--max-lora-rank", type=int, default=8)
    parser.add_argument("--dtype", default="float32", help="bfloat16 for FP8 checkpoints (vLLM's fp8 takes no float32)")
    parser.add_argument("--moe-lora-cpu", action="store_true")
    parser.add_argument("--lora-targets", nargs="+", help="vLLM's lora_target_modules")
    parser.add_argument("--mixed", action="store_true")
    args = parser.parse_args()

    if args.moe_lora_cpu:
        sys.path.insert(0, str(Path(__file__).parents[2]))  # tests/
        from vllm_moe_lora_cpu import activate

        activate()
    from vllm import LLM
    from vllm.lora.request import LoRARequest

    from allsync.engines.vllm_support import vllm_engine_kwargs

    extra = {"enable_lora": True, "max_lora_rank": args.max_lora_rank, "max_loras": 1} if args.lora else {}
    if args.lora_targets:
        extra["lora_target_modules"] = args.lora_targets
    llm = LLM(**vllm_engine_kwargs(args.checkpoint, dtype=args.dtype, max_model_len=256, **extra))
    lora = LoRARequest("adapter", 1, args.lora) if args.lora else None
    if args.mixed:
        result = mixed_rows(llm, lora)
    else:
        result = [row(o) for o in llm.generate(PROMPTS, greedy_params(), lora_request=lora)]
    with open(args.out, "w") as f:
        json.dump(result, f)


def greedy_params():
    """MAX_TOKENS greedy tokens (past eos) with their logprobs and the prompt's."""
    from vllm import SamplingParams

    return SamplingParams(temperature=0, max_tokens=MAX_TOKENS, prompt_logprobs=0, logprobs=0, ignore_eos=True)


def mixed_rows(llm, lora) -> dict:
    """Every prompt with ("lora") and without ("base") the adapter, interleaved in one batch."""
    outs = llm.generate([p for p in PROMPTS for _ in (0, 1)], greedy_params(), lora_request=[lora, None] * len(PROMPTS))
    return {"lora": [row(o) for o in outs[0::2]], "base": [row(o) for o in outs[1::2]]}


def row(o) -> dict:
    """One request's prompt ids, greedy tokens and their logprobs, and the prompt's teacher-forced logprobs."""
    tokens = list(o.outputs[0].token_ids)
    return {
        "prompt_token_ids": list(o.prompt_token_ids),
        "greedy": tokens,
        "greedy_logprobs": [d[t].logprob for d, t in zip(o.outputs[0].logprobs, tokens)],
        "prompt_logprobs": [None] + [d[t].logprob for d, t in zip(o.prompt_logprobs[1:], o.prompt_token_ids[1:])],
    }


if __name__ == "__main__":
    main()
