"""Run by the vLLM tests in a subprocess (vLLM spawns workers, so it needs a __main__ guard).

Usage: python tests/vllm_greedy_check.py CHECKPOINT OUT_JSON [--lora ADAPTER_DIR --max-lora-rank R] [--dtype D]
Writes vLLM's greedy tokens for fixed prompts and its teacher-forced logprobs of the prompt tokens;
with --lora the adapter is hot-loaded through a LoRARequest.
"""

import argparse
import json

PROMPTS = ["what is 12+7?", "the cat sat on", "Answer: 42", "compute 3*(4+5) ="]
MAX_TOKENS = 12


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("checkpoint")
    parser.add_argument("out")
    parser.add_argument("--lora")
    parser.add_argument("--max-lora-rank", type=int, default=8)
    parser.add_argument("--dtype", default="float32", help="bfloat16 for FP8 checkpoints (vLLM's fp8 takes no float32)")
    args = parser.parse_args()

    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest

    from allsync.engines.vllm_support import vllm_engine_kwargs

    extra = {"enable_lora": True, "max_lora_rank": args.max_lora_rank, "max_loras": 1} if args.lora else {}
    llm = LLM(**vllm_engine_kwargs(args.checkpoint, dtype=args.dtype, max_model_len=256, **extra))
    lora = LoRARequest("adapter", 1, args.lora) if args.lora else None
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, prompt_logprobs=0, ignore_eos=True)
    outs = llm.generate(PROMPTS, params, lora_request=lora)
    result = [
        {
            "prompt_token_ids": list(o.prompt_token_ids),
            "greedy": list(o.outputs[0].token_ids),
            "prompt_logprobs": [None] + [d[t].logprob for d, t in zip(o.prompt_logprobs[1:], o.prompt_token_ids[1:])],
        }
        for o in outs
    ]
    with open(args.out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
