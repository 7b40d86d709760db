"""Quick start: build a tiny DeepSeek-V3 checkpoint (cached), load it frozen with NF4 routed experts,
print the byte report and a greedy completion.

    python recipes/quickstart.py [--out runs/tiny-v3] [--routed-experts nf4] [--prompt "what is 12+30?"]
"""

import argparse
from pathlib import Path

from allsync.cli import greedy_completion
from moe_lora.tiny import TinySpec, make_tiny
from quant.loader import QuantPlan, byte_report, format_byte_report, load_frozen_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="runs/tiny-v3", help="where the tiny checkpoint is built (reused if there)")
    parser.add_argument("--routed-experts", default="nf4")
    parser.add_argument("--attention", default="fp8")
    parser.add_argument("--prompt", default="what is 12+30?")
    args = parser.parse_args()

    checkpoint = Path(args.out)
    if not (checkpoint / "config.json").exists():
        make_tiny(checkpoint, TinySpec(fp8=True))  # FP8 like the real DeepSeek-V3 release
        print(f"built tiny FP8 DeepSeek-V3 checkpoint in {checkpoint}")
    plan = QuantPlan(routed_experts=args.routed_experts, attention=args.attention)
    model = load_frozen_model(checkpoint, plan)
    print(format_byte_report(byte_report(model)))
    print(f"greedy completion (untrained weights): {greedy_completion(model, str(checkpoint), args.prompt, 16)!r}")


if __name__ == "__main__":
    main()
