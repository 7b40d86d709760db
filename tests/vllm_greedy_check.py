"""Run by tests/test_vllm_engine.py in a subprocess (vLLM spawns workers, so it needs a __main__ guard).

Usage: python tests/vllm_greedy_check.py CHECKPOINT OUT_JSON
Writes vLLM's greedy tokens for fixed prompts and its teacher-forced logprobs of the prompt tokens.
"""

import json
import sys

PROMPTS = ["what is 12+7?", "the cat sat on", "Answer: 42", "compute 3*(4+5) ="]
MAX_TOKENS = 12


def main(checkpoint: str, out: str) -> None:
    from vllm import LLM, SamplingParams

    from allsync.vllm_support import vllm_engine_kwargs

    llm = LLM(**vllm_engine_kwargs(checkpoint, dtype="float32", max_model_len=256))
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, prompt_logprobs=0, ignore_eos=True))
    result = [
        {
            "prompt_token_ids": list(o.prompt_token_ids),
            "greedy": list(o.outputs[0].token_ids),
            "prompt_logprobs": [None] + [d[t].logprob for d, t in zip(o.prompt_logprobs[1:], o.prompt_token_ids[1:])],
        }
        for o in outs
    ]
    with open(out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
