"""The torch engine's KV slots at full length against slots sharing pages, in the same KV room (issue 48,
rollout.kv_cache_tokens).

    python -m benchmarks.paged_slots [--rows 48] [--max-new-tokens 192] [--room-rows 4] [--slots 16] [--repeats 3]
                                     [--json FILE]

The tiny DeepSeek-V3 (moe_lora.tiny, NF4 routed experts, float32) decodes --rows samples of three prompts, an end
token chosen so that the replies are long-tailed (the token whose first appearance in replies sampled without one
falls nearest a third of --max-new-tokens), in a KV room of --room-rows rows at full length (prompt +
--max-new-tokens positions each):
    full length   --room-rows slots, each with room for a row at full length (rollout.kv_cache_tokens unset)
    paged         --slots slots sharing the same room in pages of 64 positions (moe_lora.kv_caches.SlotKVCache):
                  a row takes pages as it grows, the latest admitted is preempted when they run out
Reported per arm: decode forwards, rows per forward (decode fill of the room), positions computed (a preempted row's
second prefill included), the wall time (median of --repeats, the arms alternating) and samples per second; the
rows' tokens must be the same in both arms (each row's draws are its own).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from allsync.engines.slots import decode_in_slots
from allsync.engines.torch_engine import Sampling
from moe_lora.kv_caches import KV_PAGE_TOKENS
from moe_lora.mla_decode import install_mla_decode
from moe_lora.tiny import TinySpec, make_tiny
from quant.checkpoint_io import atomic_write_text
from quant.loader import QuantPlan, load_frozen_model

PROMPTS = [[0, 95, 80, 73], [0, 41, 86, 91, 95, 77, 90], [0, 7, 7]]


def long_tailed_end_token(model, rows, seeds, sampling) -> int:
    """The token whose first appearance in replies decoded without an end token has its median nearest a third of
    max_new_tokens (absent: max_new_tokens)."""
    out = decode_in_slots(model, rows, seeds, sampling, -1, 2, len(rows), True)
    limit = sampling.max_new_tokens
    firsts = {}
    for tokens in out.tokens:
        for t in set(tokens):
            firsts.setdefault(t, [])
    for t in firsts:
        firsts[t] = [tokens.index(t) if t in tokens else limit for tokens in out.tokens]
    return min(firsts, key=lambda t: abs(statistics.median(firsts[t]) - limit / 3))


def decode_arm(model, rows, seeds, sampling, eos: int, slots: int, pages: int | None) -> tuple[dict, list]:
    start = time.perf_counter()
    out = decode_in_slots(model, rows, seeds, sampling, eos, 2, slots, True, pages=pages)
    seconds = time.perf_counter() - start
    forwards = len(out.decodes)
    return {
        "seconds": seconds,
        "decode_forwards": forwards,
        "rows_per_forward": out.decoded_tokens / max(forwards, 1),
        "positions": out.positions,
        "samples_per_second": len(rows) / seconds,
    }, out.tokens


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=48)
    parser.add_argument("--max-new-tokens", type=int, default=192)
    parser.add_argument("--room-rows", type=int, default=4, help="the KV room, in rows at full length")
    parser.add_argument("--slots", type=int, default=16, help="the paged arm's slots")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        path = make_tiny(Path(tmp) / "tiny", TinySpec(seed=0))
        model = load_frozen_model(path, QuantPlan(routed_experts="nf4"), compute_dtype=torch.float32, progress=False)
    install_mla_decode(model)
    model.eval()
    rows = [PROMPTS[i % len(PROMPTS)] for i in range(args.rows)]
    seeds = torch.randint(0, 2**62, (len(rows),), generator=torch.Generator().manual_seed(1))
    sampling = Sampling(temperature=1.0, max_new_tokens=args.max_new_tokens)
    eos = long_tailed_end_token(model, rows, seeds, sampling)
    full = max(map(len, PROMPTS)) + args.max_new_tokens
    room = args.room_rows * full
    pages = room // KV_PAGE_TOKENS
    arms = {"full length": (args.room_rows, None), "paged": (args.slots, pages)}
    runs = {name: [] for name in arms}
    tokens = {}
    for _ in tqdm(range(args.repeats), desc="repeats", unit="repeat"):
        for name, (slots, arm_pages) in arms.items():
            measured, tokens[name] = decode_arm(model, rows, seeds, sampling, eos, slots, arm_pages)
            runs[name].append(measured)
    if tokens["paged"] != tokens["full length"]:
        raise SystemExit("the paged arm sampled other tokens than the full-length arm")
    lengths = sorted(len(t) for t in tokens["paged"])
    result = {
        "machine": "see BENCHMARKS.md",
        "torch": torch.__version__,
        "rows": args.rows,
        "max_new_tokens": args.max_new_tokens,
        "room_tokens": room,
        "pages": pages,
        "end_token": eos,
        "reply_lengths": {"median": lengths[len(lengths) // 2], "max": lengths[-1], "min": lengths[0]},
        "arms": {},
    }
    for name, measured in runs.items():
        seconds = statistics.median(m["seconds"] for m in measured)
        result["arms"][name] = {
            "slots": arms[name][0],
            "pages": arms[name][1],
            **{k: v for k, v in measured[0].items() if k not in ("seconds", "samples_per_second")},
            "seconds_median": seconds,
            "samples_per_second": args.rows / seconds,
        }
    print(f"KV room {room:,} tokens ({args.room_rows} rows of {full}); replies {result['reply_lengths']}")
    print("| arm | slots | decode forwards | rows a forward | positions computed | wall (median) | samples/s |")
    print("|---|---|---|---|---|---|---|")
    for name, a in result["arms"].items():
        print(
            f"| {name} | {a['slots']} | {a['decode_forwards']:,} | {a['rows_per_forward']:.2f} | {a['positions']:,} | "
            f"{a['seconds_median']:.2f} s | {a['samples_per_second']:.2f} |"
        )
    if args.json:
        atomic_write_text(args.json, json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
