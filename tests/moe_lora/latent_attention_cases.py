"""Checks of moe_lora.latent_attention's kernel, run by tests/moe_lora/test_latent_attention.py: on a GPU in the test
process, on CPU in a subprocess with TRITON_INTERPRET=1 (Triton reads it when it is first imported)."""

from __future__ import annotations

import torch

from moe_lora.latent_attention import latent_decode_attention
from moe_lora.kv_caches import fp8_dequantize, fp8_quantize


def reference(query, latent, counts, scaling, rank):
    """softmax over each slot's first counts[b] positions of scaling (q . latent), weights x c, in float32:
    query [B, H, r + d_rope], latent [B, S, r + d_rope] -> [B, H, r]."""
    scores = torch.einsum("bhd,bsd->bhs", query.float(), latent.float()) * scaling
    seen = torch.arange(latent.shape[1], device=latent.device)[None, None, :] < counts[:, None, None]
    probs = torch.softmax(scores.masked_fill(~seen, float("-inf")), dim=-1)
    return torch.einsum("bhs,bsr->bhr", probs, latent[..., :rank].float())


def kernel_matches_reference(device: str = "cpu") -> None:
    """Slots of 1, all and some positions (splits past a slot's count read nothing), heads not a multiple of 16, a
    rank and rotary width that are not powers of two and DeepSeek-V3's 512 + 64; the latent in the compute dtype and
    in FP8 (each compared with the FP8 values dequantized as the torch path reads them); float32 to 1e-5 of the
    output's scale, bfloat16 within its rounding; the same cache in shuffled pages read through a block table: the
    same output, bit for bit."""
    gen = torch.Generator().manual_seed(0)
    for heads, capacity, rank, rope, counts in ((20, 70, 96, 24, [1, 70, 33]), (16, 600, 512, 64, [5, 600, 131, 257])):
        slots = len(counts)
        counts = torch.tensor(counts, device=device)
        query = torch.randn(slots, heads, rank + rope, generator=gen).to(device)
        latent = torch.randn(slots, capacity, rank + rope, generator=gen).to(device)
        for dtype, tolerance in ((torch.float32, 1e-5), (torch.bfloat16, 3e-2)):
            q, cache = query.to(dtype), latent.to(dtype)
            for fp8 in (False, True):
                if fp8:
                    group = 128 if rank % 128 == 0 else rank
                    quantized, scales = fp8_quantize(cache[..., :rank], group)
                    read = torch.cat((fp8_dequantize(quantized, scales, group, dtype), cache[..., rank:]), dim=-1)
                    out = latent_decode_attention(q, quantized, scales, cache[..., rank:], counts, 0.07, capacity)
                else:
                    read = cache
                    out = latent_decode_attention(q, cache[..., :rank], None, cache[..., rank:], counts, 0.07, capacity)
                want = reference(q, read, counts, 0.07, rank)
                assert out.dtype == dtype and out.shape == (slots, heads, rank)
                error = float((out.float() - want).abs().max() / want.abs().max())
                assert error < tolerance, (heads, rank, dtype, fp8, error)
                stored = (quantized, scales, cache[..., rank:]) if fp8 else (cache[..., :rank], None, cache[..., rank:])
                assert torch.equal(paged(q, stored, counts, capacity, gen), out), (heads, rank, dtype, fp8)


def paged(query, stored, counts, capacity, gen, page: int = 64):
    """The kernel over the same positions scattered into pages of `page` positions in a shuffled order, read through
    a block table (a paged SlotKVCache's layout, page 0 unused as its scratch page)."""
    slots = query.shape[0]
    width = -(-capacity // page)
    order = torch.randperm(slots * width, generator=gen) + 1
    table = order.view(slots, width).to(query.device)
    pages = []
    for part in stored:
        if part is None:
            pages.append(None)
            continue
        padded = torch.zeros(slots, width * page, part.shape[-1], dtype=part.dtype, device=part.device)
        padded[:, :capacity] = part
        buffer = torch.zeros(slots * width + 1, page, part.shape[-1], dtype=part.dtype, device=part.device)
        buffer[table.flatten()] = padded.view(slots * width, page, -1)
        pages.append(buffer)
    return latent_decode_attention(query, *pages, counts, 0.07, capacity, table=table, page=page)


def other_blocks_give_the_same_attention(device: str = "cpu") -> None:
    """KernelBlocks (heads per program, positions per block, warps; what benchmarks/engine_decode.py sweeps): 32 and
    64 heads a program (more heads than the slots have, masked), 16 and 64 positions a block, each the reference's
    output in float32 to 1e-5, over FP8 latents in shuffled pages too; refused when not a power of two."""
    from moe_lora.latent_attention import KernelBlocks, kernel_blocks

    gen = torch.Generator().manual_seed(1)
    heads, capacity, rank, rope, counts = 40, 150, 128, 32, [1, 150, 77]
    counts = torch.tensor(counts, device=device)
    query = torch.randn(len(counts), heads, rank + rope, generator=gen).to(device)
    latent = torch.randn(len(counts), capacity, rank + rope, generator=gen).to(device)
    expected = reference(query, latent, counts, 0.07, rank)
    quantized, scales = fp8_quantize(latent[..., :rank], 128)
    read = torch.cat((fp8_dequantize(quantized, scales, 128, torch.float32), latent[..., rank:]), dim=-1)
    expected_fp8 = reference(query, read, counts, 0.07, rank)
    for blocks in (KernelBlocks(32, 16, 4), KernelBlocks(64, 64, 8), KernelBlocks(16, 64, 2)):
        with kernel_blocks(blocks):
            out = latent_decode_attention(query, latent[..., :rank], None, latent[..., rank:], counts, 0.07, capacity)
            assert torch.allclose(out, expected, atol=1e-5, rtol=0), (blocks, float((out - expected).abs().max()))
            shuffled = paged(query, (quantized, scales, latent[..., rank:]), counts, capacity, gen)
            assert torch.allclose(shuffled, expected_fp8, atol=1e-5, rtol=0), blocks
    for bad in ({"heads": 24}, {"positions": 8}, {"warps": 3}):
        try:
            KernelBlocks(**bad)
        except ValueError as e:
            assert next(iter(bad)) in str(e)
        else:
            raise AssertionError(f"KernelBlocks({bad}) was accepted")


def twelve_rows(checkpoint: str, device: str):
    """(model, rows, seeds, sampling, end tokens) of the engine checks: the tiny model with random LoRA, 12 rows (4
    samples of 3 prompts) of at most 10 tokens, and the tokens that, as eos, would end them at the most different steps
    (best first; chosen from these rows' own draws on this device, no token ending them)."""
    from allsync.engines.slots import decode_in_slots
    from allsync.engines.torch_engine import Sampling
    from tests.allsync.engines.test_decode_graphs import lora_model
    from tests.allsync.engines.test_kv_fp8 import PROMPTS
    from tests.allsync.engines.test_rollout_trainer import stop_tokens_by_variety

    model = lora_model(checkpoint, "nf4", device=device)
    rows = [p for p in PROMPTS for _ in range(4)]
    sampling = Sampling(temperature=1.0, max_new_tokens=10)
    seeds = torch.randint(0, 2**62, (len(rows),), generator=torch.Generator().manual_seed(1))
    unstopped = decode_in_slots(model, rows, seeds, sampling, -1, 2, 3, False)
    return model, rows, seeds, sampling, stop_tokens_by_variety(unstopped.tokens)


def engine_decodes_as_the_torch_path(checkpoint: str, device: str = "cpu") -> None:
    """The torch engine's decode (allsync.engines.slots.decode_in_slots) of 12 rows ending at different steps in 3
    slots, with the kernel and without: the same tokens and finish reasons, logprobs within float32 noise; over the
    latent cache in the compute dtype with live-slot steps, and in FP8 with fixed-shape steps (every slot, free ones
    included)."""
    from allsync.engines.slots import FixedShapeStep, decode_in_slots
    from tests.allsync.engines.test_rollout_trainer import FLOAT32_NOISE, assert_same_rows

    def decoded(kernel: bool, fp8: bool, fixed_step, pages=None):
        out = decode_in_slots(
            model,
            rows,
            seeds,
            sampling,
            eos,
            2,
            3,
            False,
            fixed_step=fixed_step,
            fp8_rank=512 if fp8 else None,
            kernel=kernel,
            pages=pages,
        )
        return out.tokens, out.logprobs, out.reasons

    model, rows, seeds, sampling, stop_tokens = twelve_rows(checkpoint, device)
    for fp8, fixed_step in ((False, None), (True, FixedShapeStep)):
        # the rows' lengths move the slots' batches, and on CUDA a batch's rounding can move a draw: the first of the
        # five best end tokens that ends the torch path's rows at three or more lengths. Both paths step the same
        # batches (a fixed-shape step's free slots too), so only the attention differs
        for eos in stop_tokens[:5]:
            torch_path = decoded(False, fp8, fixed_step)
            if len({len(t) for t in torch_path[0]}) >= 3:
                break
        assert len({len(t) for t in torch_path[0]}) >= 3, f"no end token of {stop_tokens[:5]} varies the lengths"
        assert_same_rows(decoded(True, fp8, fixed_step), torch_path, **FLOAT32_NOISE)
        if not fp8:
            # a paged pool (rollout.kv_cache_tokens): 4 pages for 3 slots admit two rows at a time, the kernel reading
            # through the block table (a fixed-shape step's free slot its scratch page). Not in FP8, where other
            # batches' float rounding moves latent values across FP8 steps and logprobs by ~1e-3
            paged = decoded(False, fp8, FixedShapeStep, pages=4)
            assert_same_rows(decoded(True, fp8, FixedShapeStep, pages=4), paged, **FLOAT32_NOISE)
