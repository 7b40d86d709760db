"""A decode step of DeepSeek-V3's multi-head latent attention with each cache the engine could keep (issue 46).

    python -m benchmarks.mla_decode [--heads 128] [--contexts 256,1024,2048] [--rows 2] [--steps 4] [--json out.json]

Two decoder layers (one dense, one MoE) with DeepSeek-V3's head dims (q_lora_rank 1536, kv_lora_rank 512, d_nope
128, d_rope 64, d_v 128) and --heads heads, the other widths tiny, random weights (moe_lora.tiny), float32 on the CPU
(the compute dtype of the CPU runs). For each context C: --rows rows prefilled with C tokens, then greedy decode
steps, with

    transformers  its latent cache, re-expanded through kv_b_proj at every step (what the engine did for V3)
    expanded      keys and values expanded once per token (moe_lora.kv_caches.ExpandedKVCache)
    latent        the latent cache read in latent space (moe_lora.kv_caches.LatentKVCache)

Per decode step: the median time of --steps steps (after one to warm up) and the cache's bytes per token and layer. The three give the same tokens (tests/allsync/engines/test_rollout_trainer.py).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from transformers import DynamicCache

from moe_lora.kv_caches import ExpandedKVCache, LatentKVCache
from moe_lora.mla_decode import install_mla_decode
from moe_lora.tiny import TinySpec, make_tiny
from quant.checkpoint_io import atomic_write_text
from quant.loader import QuantPlan, load_frozen_model

CACHES = {
    "transformers": lambda model, reserve: DynamicCache(config=model.config),
    "expanded": lambda model, reserve: ExpandedKVCache(reserve=reserve),
    "latent": lambda model, reserve: LatentKVCache(reserve=reserve),
}


def v3_head_dims_model(heads: int, directory: Path):
    spec = TinySpec(layers=2, heads=heads, q_lora_rank=1536, qk_nope_head_dim=128, v_head_dim=128, seed=0)
    path = make_tiny(directory / "v3-heads", spec)
    model = load_frozen_model(path, QuantPlan(routed_experts="nf4"), compute_dtype=torch.float32, progress=False)
    install_mla_decode(model)
    return model.eval()


def decode_step_ms(model, cache: str, rows: int, context: int, steps: int) -> float:
    """Milliseconds per decode step of `rows` rows over a context of `context` tokens: the rows prefilled once, one
    step to warm up, then `steps` steps timed one by one (the median)."""
    prompt = torch.randint(3, 200, (rows, context), generator=torch.Generator().manual_seed(context))
    kv = CACHES[cache](model, steps + 1)
    out = model(input_ids=prompt, past_key_values=kv, use_cache=True, logits_to_keep=1)
    token = out.logits[:, -1].argmax(-1, keepdim=True)
    times = []
    for step in range(steps + 1):
        position = torch.full((rows, 1), context + step)
        start = time.perf_counter()
        out = model(input_ids=token, position_ids=position, past_key_values=kv, use_cache=True, logits_to_keep=1)
        token = out.logits[:, -1].argmax(-1, keepdim=True)
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times[1:])


def bytes_per_token_and_layer(config, cache: str) -> int:
    """float32 values a cached token holds per layer: H (d_nope + d_rope + d_v) expanded, r + d_rope latent."""
    expanded = config.num_attention_heads * (config.qk_nope_head_dim + config.qk_rope_head_dim + config.v_head_dim)
    return 4 * (expanded if cache == "expanded" else config.kv_lora_rank + config.qk_rope_head_dim)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--heads", type=int, default=128)
    parser.add_argument("--contexts", default="256,1024,2048")
    parser.add_argument("--rows", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    if min(args.steps, args.rows, args.heads) < 1:
        parser.error("--steps, --rows and --heads must be >= 1")
    contexts = [int(c) for c in args.contexts.split(",")]
    torch.manual_seed(0)
    results = []
    with tempfile.TemporaryDirectory(prefix="allsync-mla-decode-") as tmp, torch.no_grad():
        model = v3_head_dims_model(args.heads, Path(tmp))
        for context in contexts:
            for cache in CACHES:
                ms = decode_step_ms(model, cache, args.rows, context, args.steps)
                row = {
                    "context": context,
                    "cache": cache,
                    "rows": args.rows,
                    "ms_per_step": round(ms, 2),
                    "cache_bytes_per_token_layer": bytes_per_token_and_layer(model.config, cache),
                }
                results.append(row)
                print(
                    f"context {context:>6,}  {cache:<12}  {ms:8.1f} ms per decode step of {args.rows} rows  "
                    f"(cache {row['cache_bytes_per_token_layer']:,} B per token and layer)",
                    flush=True,
                )
    if args.json:
        atomic_write_text(args.json, json.dumps({"heads": args.heads, "results": results}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
