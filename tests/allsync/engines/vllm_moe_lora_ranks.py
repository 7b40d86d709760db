"""vLLM with LoRA on routed experts over two ranks on the CPU (the harness of tests/vllm_moe_lora_cpu.py), run by the
tests under `torchrun --standalone --nproc_per_node 2` (vLLM's external launcher: each process one rank).

Usage: vllm_moe_lora_ranks.py CHECKPOINT ADAPTER OUT_PREFIX --layout tp|dp [--second lora|base|idle] [--fix] [--pin]
  tp: TP2 x EP2, every rank generates every prompt, each with and without the adapter (rank 0 writes them);
  dp: DP2 x EP2, rank r generates its half of the prompts (with the adapter; rank 1 without it with --second base,
      none with --second idle) and writes OUT_PREFIX.rank<r>.json.
"""

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[2]))  # tests/
from vllm_moe_lora_cpu import activate

activate()  # before vLLM's import

from vllm import LLM
from vllm.lora.request import LoRARequest

from allsync.engines.vllm_support import vllm_engine_kwargs
from tests.allsync.engines.vllm_greedy_check import PROMPTS, greedy_params, mixed_rows, row


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("checkpoint")
    parser.add_argument("adapter")
    parser.add_argument("out_prefix")
    parser.add_argument("--layout", choices=["tp", "dp"], required=True)
    parser.add_argument("--second", choices=["lora", "base", "idle"], default="lora")
    parser.add_argument("--fix", action="store_true", help="allsync's fix of vLLM's DP x EP LoRA (vllm_dp_lora)")
    parser.add_argument("--pin", action="store_true", help="every rank holds the adapter in its slot")
    args = parser.parse_args()
    if args.fix:
        from allsync.engines.vllm_dp_lora import apply_dp_lora_fix

        apply_dp_lora_fix()
    rank = int(os.environ["RANK"])
    sizes = {"tensor_parallel_size": 2} if args.layout == "tp" else {"data_parallel_size": 2}
    llm = LLM(
        **vllm_engine_kwargs(
            args.checkpoint,
            dtype="float32",
            max_model_len=256,
            enable_lora=True,
            max_lora_rank=8,
            max_loras=1,
            lora_target_modules=["experts"],
            enable_expert_parallel=True,
            distributed_executor_backend="external_launcher",
            **sizes,
        )
    )
    lora = LoRARequest("adapter", 1, args.adapter)
    if args.layout == "tp":
        result = mixed_rows(llm, lora)
        if rank == 0:
            Path(f"{args.out_prefix}.json").write_text(json.dumps(result))
        return
    if args.pin:  # every rank holds the adapter in its slot, whatever its own requests use
        from allsync.engines.vllm_dp_lora import hold_adapter

        hold_adapter(llm, lora)
    mine = PROMPTS[rank * 2 : rank * 2 + 2] if rank == 0 or args.second != "idle" else []
    use = lora if rank == 0 or args.second == "lora" else None
    outs = llm.generate(mine, greedy_params(), lora_request=use)
    Path(f"{args.out_prefix}.rank{rank}.json").write_text(json.dumps([row(o) for o in outs]))


if __name__ == "__main__":
    main()
