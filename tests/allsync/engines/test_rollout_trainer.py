"""Rollout engine and trainer pieces on the tiny model: logprobs agree, masks line up, updates are exact."""

from collections import Counter

import pytest
import torch

from allsync.engines.torch_engine import Sampling, TorchEngine, check_plain_logits
from evals.generation import cut_at_eos, left_pad
from allsync.update.forward import forward_logprobs
from allsync.update.sequences import build_sequences, scatter_response_values
from quant.loader import QuantPlan, load_frozen_model


@pytest.fixture(scope="module")
def model(tiny_bf16):
    return load_frozen_model(tiny_bf16, QuantPlan(routed_experts="nf4"), compute_dtype=torch.float32, progress=False)


def test_cut_at_eos_and_left_pad():
    assert cut_at_eos([5, 6, 1, 2, 2], eos_id=1) == ([5, 6, 1], "stop")
    assert cut_at_eos([5, 6, 7], eos_id=1) == ([5, 6, 7], "length")
    ids, mask = left_pad([[7, 8, 9], [4]], pad_id=2)
    assert ids.tolist() == [[7, 8, 9], [2, 2, 4]] and mask.tolist() == [[1, 1, 1], [0, 0, 1]]


def test_sequence_masks_line_up_with_response_tokens():
    batch = build_sequences([[0, 5, 6], [0, 7]], [[10, 11], [12, 13, 1]], pad_id=2)
    assert batch.input_ids.tolist() == [[0, 5, 6, 10, 11], [0, 7, 12, 13, 1]]
    # position t predicts token t+1: response tokens are predicted at 2,3 (row 0) and 1,2,3 (row 1)
    assert batch.response_mask.tolist() == [[0, 0, 1, 1], [0, 1, 1, 1]]
    placed = scatter_response_values([[-1.0, -2.0], [-3.0, -4.0, -5.0]], batch)
    assert placed.tolist() == [[0, 0, -1, -2], [0, -3, -4, -5]]
    short = build_sequences([[0, 5]], [[9]], pad_id=2).select([0])
    assert short.input_ids.tolist() == [[0, 5, 9]] and short.attention_mask.tolist() == [[1, 1, 1]]


def test_engine_logprobs_equal_trainer_logprobs(model):
    engine = TorchEngine(model, eos_id=1, pad_id=2)
    prompts = [[0, 95, 80, 73], [0, 41, 86, 91, 95, 77, 90]]  # different lengths: left padding in the engine
    torch.manual_seed(0)
    rollout = engine.generate(prompts, n=3, sampling=Sampling(temperature=0.7, max_new_tokens=6))
    assert rollout.group_index == [0, 0, 0, 1, 1, 1] and rollout.adapter_version == 0
    batch = build_sequences(rollout.prompt_ids, rollout.response_ids, pad_id=2)  # right padding in the trainer
    with torch.no_grad():
        trainer = forward_logprobs(model, batch, temperature=0.7)
    engine_lp = scatter_response_values(rollout.logprobs, batch)
    assert ((engine_lp - trainer).abs() * batch.response_mask).max() < 1e-4


def test_greedy_generation_is_the_argmax_path(model):
    engine = TorchEngine(model, eos_id=1, pad_id=2)
    rollout = engine.generate([[0, 95, 80, 73]], n=1, sampling=Sampling(max_new_tokens=5, greedy=True))
    seq = [0, 95, 80, 73]
    for _ in range(5):
        with torch.no_grad():
            seq.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
        if seq[-1] == 1:
            break
    assert rollout.response_ids[0] == seq[4:]


def frequent_stop_token(model, prompts, n, sampling, seed) -> int:
    """A token whose first occurrence falls at the most different positions of these samples: used as eos,
    the same seed then gives responses that stop at different lengths (a random tiny model rarely says eos)."""
    torch.manual_seed(seed)
    return most_varied_stop_token(TorchEngine(model, eos_id=1, pad_id=2).generate(prompts, n, sampling).response_ids)


def stop_tokens_by_variety(rows: list[list[int]]) -> list[int]:
    """The tokens in these responses, the one whose first occurrence falls at the most different positions first
    (a token in all of them last): as eos, these rows would stop at that many different lengths."""
    positions = {t: {row.index(t) for row in rows if t in row} for t in {t for row in rows for t in row}}
    counts = Counter(t for row in rows for t in set(row))
    return sorted(positions, key=lambda t: (len(positions[t]) if counts[t] < len(rows) else 0, counts[t]), reverse=True)


def most_varied_stop_token(rows: list[list[int]]) -> int:
    """stop_tokens_by_variety's first."""
    return stop_tokens_by_variety(rows)[0]


def reference_samples(model, rows, seeds, sampling, eos_id):
    """Each row decoded alone by plain forwards of the whole sequence (transformers' attention, no cache), its draws
    the engine's for its seed (allsync.engines.slots.sample_rows): (tokens, logprobs, finish reasons)."""
    from allsync.engines.slots import sample_rows

    tokens, logprobs, reasons = [], [], []
    for prompt, seed in zip(rows, seeds):
        seq, lps, reason = list(prompt), [], "length"
        for step in range(sampling.max_new_tokens):
            with torch.no_grad():
                scores = model(torch.tensor([seq])).logits[:, -1].float()
            chosen, lp = sample_rows(scores, seed[None], torch.tensor([step]), sampling)
            seq.append(int(chosen))
            lps.append(float(lp))
            if seq[-1] == eos_id:
                reason = "stop"
                break
        tokens.append(seq[len(prompt) :])
        logprobs.append(lps)
        reasons.append(reason)
    return tokens, logprobs, reasons


# two float32 computations of the same logprobs in other shapes (a fixed-shape step against the live slots, another
# batch, another CPU's kernels): each rounding is 2^-24 of a value, and the logits come through a few layers of sums
# over up to ~10^3 terms reordered, so they differ by tens of ulps of the logits' size (seen: 4.5e-5 at a logprob of
# -6.3, 7e-6 of it, with AVX2 kernels), not by a fixed number: atol for logprobs near 0, rtol of 2^-23 x 128 for the rest
FLOAT32_NOISE = {"atol": 2e-5, "rtol": 2**-23 * 128}
# a value quantized to e4m3 in both computations can land on either side of a rounding boundary when its float32 noise
# straddles one: the rounded value then moves by one e4m3 step (2^-3 of it), which moves the logprobs by up to ~1e-3
# on these random tiny models (measured 3e-4 for the FP8 GEMMs' inputs)
E4M3_BOUNDARY = {"atol": 5e-3, "rtol": 0.0}


def assert_same_rows(got, want, atol=None, rtol=0.0, seeds=None):
    """Decoded rows (tokens, logprobs, reasons) equal: the same tokens and reasons, logprobs within atol + rtol |b|.

    seeds (the rows' sampling streams): two computations that differ by rounding may sample another token where two
    candidates tie within it. Gumbel-max takes argmax(logprob + g) with g the row's draws at that step
    (allsync.engines.slots.gumbel_noise), so at the first token where a row differs, each side's chosen token must
    beat the other's by less than twice the logprob tolerance (log softmax(s / T) + g orders the tokens as s / T + g
    does): a near tie, after which the row is not compared (its later tokens follow other prefixes). Anything else is
    a real difference."""
    from allsync.engines.slots import gumbel_noise

    for row, (a_tokens, b_tokens) in enumerate(zip(got[0], want[0])):
        a_lp, b_lp = torch.tensor(got[1][row], dtype=torch.float64), torch.tensor(want[1][row], dtype=torch.float64)
        tie = next((i for i, (x, y) in enumerate(zip(a_tokens, b_tokens)) if x != y), None)
        if tie is None:
            assert a_tokens == b_tokens and got[2][row] == want[2][row], f"row {row}"
            torch.testing.assert_close(a_lp, b_lp, atol=atol, rtol=rtol, msg=f"row {row}")
            continue
        assert seeds is not None, f"row {row}: token {tie} differs ({a_tokens[tie]} against {b_tokens[tie]})"
        torch.testing.assert_close(a_lp[:tie], b_lp[:tie], atol=atol, rtol=rtol, msg=f"row {row}")
        vocab = max(a_tokens[tie], b_tokens[tie]) + 1
        g = gumbel_noise(seeds[row : row + 1], torch.tensor([tie]), vocab)[0].double()
        margin = abs(float(a_lp[tie] + g[a_tokens[tie]]) - float(b_lp[tie] + g[b_tokens[tie]]))
        bound = 2 * (atol + rtol * abs(float(b_lp[tie])))
        assert margin <= bound, f"row {row}: token {tie} differs by {margin:.3g} > {bound:.3g}: not a near tie"


def decode(model, rows, seeds, sampling, eos_id, slots, expanded, pages=None):
    from allsync.engines.slots import decode_in_slots
    from moe_lora.mla_decode import install_mla_decode

    install_mla_decode(model)
    out = decode_in_slots(model, rows, seeds, sampling, eos_id, 2, slots, expanded, pages=pages)
    return out.tokens, out.logprobs, out.reasons


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_engine_logprobs_are_computed_per_step_and_equal_a_plain_forward(model, temperature):
    """Issue 9 item 13: the engine gathers each step's chosen-token logprob as it generates (no [B, L, V]
    of kept logits); they equal log softmax(logits / T) of a teacher-forced forward of each sample alone
    (no padding), and rows stop at eos at different lengths."""
    prompts = [[0, 95, 80, 73], [0, 41, 86, 91, 95, 77, 90]]
    sampling = Sampling(temperature=temperature, max_new_tokens=10)
    eos = frequent_stop_token(model, prompts, 4, sampling, seed=0)
    engine = TorchEngine(model, eos_id=eos, pad_id=2, batch_size=3)  # 8 samples through 3 slots

    torch.manual_seed(0)
    rollout = engine.generate(prompts, n=4, sampling=sampling)

    stopped = {len(r) for r, f in zip(rollout.response_ids, rollout.finish_reasons) if f == "stop"}
    assert len(stopped) >= 2 and "length" in rollout.finish_reasons  # eos at different lengths
    assert all(len(lp) == len(r) for lp, r in zip(rollout.logprobs, rollout.response_ids))

    for prompt, response, engine_lp in zip(rollout.prompt_ids, rollout.response_ids, rollout.logprobs):
        with torch.no_grad():
            logits = model(torch.tensor([prompt + response])).logits[0].float()
        reference = torch.log_softmax(logits / temperature, -1)[len(prompt) - 1 : -1].gather(
            -1, torch.tensor(response)[:, None]
        )
        # float32 noise of the cached batch against one uncached row (measured up to 1.7e-5 at |logprob| ~ 3)
        torch.testing.assert_close(torch.tensor(engine_lp), reference.squeeze(-1), atol=1e-5, rtol=1e-5)


def test_no_prompts_give_an_empty_rollout(model):
    """A rank with nothing to generate (expert parallelism's lockstep calls generate with no prompts)."""
    rollout = TorchEngine(model, eos_id=1, pad_id=2).generate([], 4, Sampling(max_new_tokens=5))
    assert len(rollout) == 0 and rollout.response_ids == [] and rollout.routing == []


def test_gumbel_max_draws_sample_the_softmax():
    """argmax(scores / T + Gumbel noise) over 40,000 seeds: every token's frequency within 4 standard errors of
    softmax(scores / T); a row's draws depend on its seed and token index only."""
    from allsync.engines.slots import gumbel_noise, sample_rows

    rows = 40_000
    scores = torch.tensor([[2.0, 1.0, 0.0, -1.0, 0.5]]).expand(rows, -1)
    seeds = torch.randint(0, 2**62, (rows,), generator=torch.Generator().manual_seed(0))
    for temperature in (1.0, 0.7):
        chosen, _ = sample_rows(scores, seeds, torch.zeros(rows, dtype=torch.long), Sampling(temperature=temperature))
        p = torch.softmax(scores[0] / temperature, -1)
        freq = torch.bincount(chosen, minlength=5).float() / rows
        assert ((freq - p).abs() <= 4 * (p * (1 - p) / rows).sqrt()).all(), (freq, p)
    noise = gumbel_noise(seeds[:3], torch.tensor([0, 1, 2]), 7)
    again = gumbel_noise(seeds[[2, 0]], torch.tensor([2, 0]), 7)
    assert torch.equal(noise[[2, 0]], again) and noise.isfinite().all()
    assert not torch.equal(gumbel_noise(seeds[:1], torch.tensor([1]), 7), noise[:1])  # another token index


def test_each_row_samples_what_it_samples_alone(model):
    """Issue 46: continuous batching over 3 slots, 12 rows of 3 prompts stopping at different lengths (slots freed
    and refilled): each row's tokens, logprobs and finish reason equal that row decoded alone (one slot) with its
    seed, and a plain forward of the whole sequence, draw for draw."""
    prompts = [[0, 95, 80, 73], [0, 41, 86, 91, 95, 77, 90], [0, 7, 7]]
    rows = [p for p in prompts for _ in range(4)]
    sampling = Sampling(temperature=1.0, max_new_tokens=8)
    eos = frequent_stop_token(model, prompts, 4, sampling, seed=1)
    seeds = torch.randint(0, 2**62, (len(rows),), generator=torch.Generator().manual_seed(1))
    pooled = decode(model, rows, seeds, sampling, eos, slots=3, expanded=True)
    assert len({len(t) for t in pooled[0]}) >= 3  # rows end at different steps
    alone = [decode(model, [r], seeds[i : i + 1], sampling, eos, slots=1, expanded=True) for i, r in enumerate(rows)]
    assert_same_rows(pooled, tuple([x for a in alone for x in a[k]] for k in range(3)), **FLOAT32_NOISE)
    assert_same_rows(pooled, reference_samples(model, rows, seeds, sampling, eos), **FLOAT32_NOISE)


@pytest.mark.parametrize("expanded", [True, False])
def test_a_paged_pool_preempts_and_each_row_samples_what_it_samples_alone(model, expanded):
    """Issue 48 (rollout.kv_cache_tokens): 4 slots sharing 4 pages of 64 positions, rows of up to 3 pages: at most
    two rows fit at once, and rows are preempted when their next page is not free, then prefilled again with the
    tokens they had. Each row's tokens, logprobs and finish reason equal the unpaged pool's (every slot at full
    length), whose rows each equal a solo decode (test above)."""
    from allsync.engines.slots import decode_in_slots
    from moe_lora.mla_decode import install_mla_decode

    install_mla_decode(model)
    prompts = [[0, 95, 80, 73], [0, 41, 86, 91, 95, 77, 90], [0, 7, 7]]
    rows = [p for p in prompts for _ in range(2)]
    sampling = Sampling(temperature=1.0, max_new_tokens=150)
    seeds = torch.randint(0, 2**62, (len(rows),), generator=torch.Generator().manual_seed(4))
    unpaged = decode_in_slots(model, rows, seeds, sampling, 1, 2, 4, expanded)
    paged = decode_in_slots(model, rows, seeds, sampling, 1, 2, 4, expanded, pages=4)
    assert max(map(len, unpaged.tokens)) > 2 * 64  # rows take three pages
    assert paged.positions > unpaged.positions  # preempted rows were prefilled again
    assert_same_rows(
        (paged.tokens, paged.logprobs, paged.reasons),
        (unpaged.tokens, unpaged.logprobs, unpaged.reasons),
        **FLOAT32_NOISE,
    )


def test_a_paged_engine_records_each_rows_routing_once_through_preemptions(model):
    """A preempted row's routing (what the trainer replays) is its prompt's, then one entry per fed token, the one
    its second prefill fed taken from that prefill: equal to the unpaged engine's, entry for entry."""
    prompts = [[0, 95, 80, 73], [0, 41, 86, 91, 95, 77, 90]]
    sampling = Sampling(temperature=1.0, max_new_tokens=150)
    out = {}
    for tokens in (None, 256):
        engine = TorchEngine(model, eos_id=1, pad_id=2, batch_size=4, kv_cache_tokens=tokens)
        torch.manual_seed(5)
        out[tokens] = engine.generate(prompts, 2, sampling), engine.positions
    (unpaged, unpaged_positions), (paged, paged_positions) = out[None], out[256]
    assert paged_positions > unpaged_positions and paged.response_ids == unpaged.response_ids
    assert [r.shape for r in paged.routing] == [r.shape for r in unpaged.routing]
    assert all(torch.equal(a, b) for a, b in zip(paged.routing, unpaged.routing))


def test_a_paged_pool_refuses_room_for_less_than_one_row():
    from moe_lora.kv_caches import SlotKVCache

    with pytest.raises(ValueError, match="cannot admit one row of 200 positions"):
        SlotKVCache(4, 200, pages=4)
    SlotKVCache(4, 200, pages=5)


def test_generation_configs_that_change_the_sampled_distribution_are_refused():
    """The engine's logprobs are log softmax(logits / T): a checkpoint asking generate() for a repetition
    penalty (a processor transformers runs before ours) or min_p (a warper after temperature) is refused."""
    from transformers import GenerationConfig

    check_plain_logits(GenerationConfig())
    check_plain_logits(
        GenerationConfig(bos_token_id=0, eos_token_id=1, do_sample=True, temperature=0.6, top_p=0.95)
    )  # DeepSeek-V3's
    for setting in ({"repetition_penalty": 1.2}, {"min_p": 0.05}, {"no_repeat_ngram_size": 3}):
        with pytest.raises(ValueError, match=next(iter(setting))):
            check_plain_logits(GenerationConfig(**setting))


def test_the_expanded_and_the_latent_slots_sample_what_transformers_samples(model):
    """Issues 24 and 46: slots holding MLA keys/values expanded once per token, and slots holding the latent read in
    latent space (q absorbed through W_UK, output through W_UV), against plain forwards of the whole sequence
    (transformers' attention): the same tokens, and logprobs within float32 noise. The tiny model's engine keeps the
    expanded cache (4 heads x (32 + 64 + 32) = 512 <= 576)."""
    prompts = [[0, 95, 80, 73], [0, 41, 86, 91, 95, 77, 90]]
    rows = [p for p in prompts for _ in range(3)]
    sampling = Sampling(temperature=1.0, max_new_tokens=8)
    seeds = torch.randint(0, 2**62, (len(rows),), generator=torch.Generator().manual_seed(3))
    assert TorchEngine(model, eos_id=1, pad_id=2).expanded_kv
    want = reference_samples(model, rows, seeds, sampling, eos_id=1)
    for expanded in (True, False):
        assert_same_rows(decode(model, rows, seeds, sampling, 1, slots=4, expanded=expanded), want, **FLOAT32_NOISE)


@pytest.fixture(scope="module")
def v3_heads_model(tmp_path_factory):
    """Two layers (one dense, one MoE) with DeepSeek-V3's head dims (q_lora_rank 1536, kv_lora_rank 512, d_nope 128,
    d_rope 64, d_v 128; 16 heads, not 128, to stay small), random weights, LoRA on every attention projection with
    random B (kv_b_proj's and q_b_proj's included)."""
    from moe_lora.lora import LoRAConfig, attach_lora
    from moe_lora.lora_layers import LoRALinear
    from moe_lora.tiny import TinySpec, make_tiny

    spec = TinySpec(layers=2, heads=16, q_lora_rank=1536, qk_nope_head_dim=128, v_head_dim=128, seed=1)
    path = make_tiny(tmp_path_factory.mktemp("ckpt") / "v3-heads", spec)
    model = load_frozen_model(path, QuantPlan(routed_experts="nf4"), compute_dtype=torch.float32, progress=False)
    attach_lora(model, LoRAConfig(rank=8, alpha=16))
    gen = torch.Generator().manual_seed(0)
    for m in model.modules():
        if isinstance(m, LoRALinear):
            m.lora_B.data.normal_(0, 0.02, generator=gen)
    return model


def test_the_latent_cache_samples_what_transformers_samples_at_deepseek_v3_head_dims(v3_heads_model):
    """Issue 46: at V3's head dims the engine keeps the latent cache (16 x 320 = 5,120 expanded values per token
    against 576) and attends in latent space, LoRA on kv_b_proj in factored form: the tokens of plain forwards of
    the whole sequence and logprobs within float32 noise, rows of different lengths in 3 slots; with the adapters
    off (the reference policy) too."""
    from moe_lora.lora import adapters_disabled

    model = v3_heads_model
    assert not TorchEngine(model, eos_id=1, pad_id=2).expanded_kv
    rows = [p for p in ([0, 95, 80, 73, 11], [0, 41, 86]) for _ in range(2)]
    sampling = Sampling(temperature=1.0, max_new_tokens=10)
    seeds = torch.randint(0, 2**62, (len(rows),), generator=torch.Generator().manual_seed(4))
    latent = decode(model, rows, seeds, sampling, 1, slots=3, expanded=False)
    assert_same_rows(latent, reference_samples(model, rows, seeds, sampling, 1), **FLOAT32_NOISE)
    with adapters_disabled(model):  # the reference policy: kv_b_proj's base alone
        base = decode(model, rows, seeds, sampling, 1, slots=3, expanded=False)
        assert_same_rows(base, reference_samples(model, rows, seeds, sampling, 1), **FLOAT32_NOISE)
    assert base[1] != latent[1]  # the LoRA was applied


def test_a_latent_cache_continues_a_sequence_with_several_new_tokens(v3_heads_model):
    """A forward of 3 new tokens onto a latent cache of 5 (the causal offset mask of `absorbed_attention`, no
    attention mask given) gives the logits of one forward of all 8 tokens."""
    from moe_lora.kv_caches import LatentKVCache

    model = v3_heads_model
    ids = torch.tensor([[0, 95, 80, 73, 11, 41, 86, 7]])
    with torch.no_grad():
        whole = model(input_ids=ids).logits
        cache = LatentKVCache(reserve=4)
        first = model(input_ids=ids[:, :5], past_key_values=cache, use_cache=True).logits
        rest = model(input_ids=ids[:, 5:], past_key_values=cache, use_cache=True).logits
    assert cache.get_seq_length() == 8 and cache.layers[0].keys.shape[-1] == 512 + 64  # the latent, nothing else
    torch.testing.assert_close(torch.cat([first, rest], dim=1), whole, atol=2e-5, rtol=0)


def test_the_latent_path_refuses_a_kv_b_proj_it_cannot_apply(v3_heads_model):
    from types import SimpleNamespace

    from moe_lora.mla_decode import kv_b_weight

    attn = SimpleNamespace(kv_b_proj=torch.nn.Conv1d(1, 1, 1), layer_idx=1)
    with pytest.raises(TypeError, match=r"model.layers.1.self_attn.kv_b_proj is a Conv1d"):
        kv_b_weight(attn, torch.float32)


def test_merged_lora_generates_the_unmerged_policy(tiny_bf16):
    """rollout.merge_lora: generation reads W + s B A formed once per call on every LoRALinear with a compute copy.
    The same tokens as the unmerged forward from the same seed, logprobs within float32 rounding; a forward with
    gradients inside the block still computes the unmerged form, and nothing merged is left after the call."""
    from moe_lora.lora import LoRAConfig, attach_lora, lora_merged
    from moe_lora.lora_layers import LoRALinear
    from quant.modules import keep_compute_copies

    model = load_frozen_model(tiny_bf16, QuantPlan(routed_experts="nf4"), compute_dtype=torch.float32, progress=False)
    attach_lora(model, LoRAConfig(rank=8, alpha=16))
    keep_compute_copies(model, torch.float32)
    linears = [m for m in model.modules() if isinstance(m, LoRALinear)]
    gen = torch.Generator().manual_seed(0)
    for m in linears:
        m.lora_B.data.normal_(0, 0.05, generator=gen)
    prompts, sampling = [[0, 95, 80, 73], [0, 41, 86, 91, 95, 77, 90]], Sampling(temperature=1.0, max_new_tokens=8)
    rollouts = []
    for merge in (False, True):
        torch.manual_seed(3)
        rollouts.append(
            TorchEngine(model, eos_id=1, pad_id=2, merge_lora=merge).generate(prompts, n=3, sampling=sampling)
        )
    assert rollouts[0].response_ids == rollouts[1].response_ids
    for a, b in zip(rollouts[0].logprobs, rollouts[1].logprobs):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), atol=1e-4, rtol=0)
    assert all(m.merged is None for m in linears)
    x = torch.randn(2, 3, linears[0].base.in_features)
    with lora_merged(model):
        assert all(m.merged is not None for m in linears)
        linears[0](x).sum().backward()
    assert linears[0].lora_B.grad is not None and linears[0].lora_B.grad.abs().sum() > 0


def test_expanded_cache_fits_only_where_it_is_no_larger():
    from transformers import DeepseekV3Config

    from moe_lora.kv_caches import expanded_cache_fits

    v3 = DeepseekV3Config()  # DeepSeek-V3's shape: 128 heads x 320 values against 576 latent ones
    assert (v3.num_attention_heads, v3.kv_lora_rank) == (128, 512) and not expanded_cache_fits(v3)
    tiny = DeepseekV3Config(
        num_attention_heads=2, qk_nope_head_dim=32, qk_rope_head_dim=64, v_head_dim=32, kv_lora_rank=512
    )
    assert expanded_cache_fits(tiny)


def test_the_reserved_cache_layer_holds_what_concatenation_holds():
    """ReservedLayer writes into preallocated buffers: after a prefill, a batch reorder, decode steps past the
    reserve and a crop, its keys and values equal transformers' concatenating DynamicLayer bit for bit, and a
    decode step within the reserve writes in place (no new buffer)."""
    from transformers.cache_utils import DynamicLayer

    from moe_lora.kv_caches import ReservedLayer

    gen = torch.Generator().manual_seed(0)
    ours, ref = ReservedLayer(reserve=3), DynamicLayer()

    def update(length: int, batch: int = 4):
        k, v = torch.randn(batch, 2, length, 6, generator=gen), torch.randn(batch, 2, length, 5, generator=gen)
        got, want = ours.update(k, v), ref.update(k, v)
        assert all(torch.equal(g, w) for g, w in zip(got, want))

    update(5, batch=2)
    for layer in (ours, ref):
        layer.batch_select_indices(torch.tensor([0, 0, 1, 1]))
    update(1)
    buffer = ours.buffers[0]
    update(1)
    assert ours.buffers[0] is buffer and ours.keys.data_ptr() == buffer.data_ptr()  # in place within the reserve
    for _ in range(4):
        update(1)
    assert ours.buffers[0] is not buffer and ours.get_seq_length() == ref.get_seq_length() == 11
    for layer in (ours, ref):
        layer.crop(-2)
    update(1)


def test_prompts_are_prefilled_once_per_run_of_equal_rows():
    from allsync.engines.slots import runs_of_equal

    assert runs_of_equal([[1, 2], [1, 2], [3], [1, 2]]) == ([[1, 2], [3], [1, 2]], [2, 1, 1])
    assert runs_of_equal([]) == ([], [])


def test_rows_cut_at_their_limit_continue_without_a_prefill_while_the_policy_is_unchanged(model):
    """Issue 46 item 3: generate(keep=True) keeps the cached positions of the rows that reached max_new_tokens; the next
    call given those rows continued (prompt + tokens) decodes them from their slots without a prefill: the same tokens,
    finish reasons and recorded routing as a fresh engine prefilling them, logprobs within float32 noise, and fewer
    positions computed. After an in-place change of a parameter (an optimizer step) they are prefilled again."""
    prompts = [[0, 95, 80, 73], [0, 41, 86, 91, 95, 77, 90], [0, 7, 7]]
    window = Sampling(temperature=1.0, max_new_tokens=4)
    engine = TorchEngine(model, eos_id=1, pad_id=2, batch_size=3)
    torch.manual_seed(0)
    first = engine.generate(prompts, 2, window, keep=True)
    assert set(first.finish_reasons) == {"length"} and len(engine.kept.rows) == 6
    continued = [p + r for p, r in zip(first.prompt_ids, first.response_ids)]

    def second_window(e):
        torch.manual_seed(1)
        before = e.positions
        out = e.generate(continued, 1, window, keep=True)
        return out, e.positions - before

    resumed, resumed_positions = second_window(engine)
    fresh, fresh_positions = second_window(TorchEngine(model, eos_id=1, pad_id=2, batch_size=3))
    assert resumed.response_ids == fresh.response_ids and resumed.finish_reasons == fresh.finish_reasons
    assert_same_rows(
        (resumed.response_ids, resumed.logprobs, resumed.finish_reasons),
        (fresh.response_ids, fresh.logprobs, fresh.finish_reasons),
        **FLOAT32_NOISE,
    )
    assert all(torch.equal(a, b) for a, b in zip(resumed.routing, fresh.routing))
    assert resumed_positions == 6 * 4 < fresh_positions  # decode steps only: 4 tokens each, no prefill
    continued = [p + r for p, r in zip(resumed.prompt_ids, resumed.response_ids)]
    with torch.no_grad():
        next(model.parameters()).add_(0.0)  # an in-place update through the parameter (even one that moves nothing)
    moved, moved_positions = second_window(engine)
    assert moved_positions == second_window(TorchEngine(model, eos_id=1, pad_id=2, batch_size=3))[1]


def test_rows_may_part_only_at_a_near_tie():
    """assert_same_rows with seeds: a row whose token differs where the two candidates' Gumbel-perturbed logprobs tie
    within the tolerance passes (and is not compared after it); one where they are a nat apart fails, and so does any
    difference without seeds."""
    from allsync.engines.slots import gumbel_noise

    seeds = torch.tensor([12345, 678])
    g = gumbel_noise(seeds[:1], torch.tensor([1]), 8)[0].double()
    want = ([[4, 3, 1]], [[-1.0, -2.0, -0.5]], ["stop"])
    tied = -2.0 + float(g[3] - g[5])  # token 5's logprob + its draw equals token 3's
    for gap, passes in ((1e-6, True), (1.0, False)):
        got = ([[4, 5, 7, 7]], [[-1.0 + 1e-6, tied + gap, -3.0, -3.0]], ["length"])
        if passes:
            assert_same_rows(got, want, **FLOAT32_NOISE, seeds=seeds[:1])
        else:
            with pytest.raises(AssertionError, match="not a near tie"):
                assert_same_rows(got, want, **FLOAT32_NOISE, seeds=seeds[:1])
    with pytest.raises(AssertionError, match="token 1 differs"):
        assert_same_rows(([[4, 5]], [[-1.0, tied]], ["stop"]), want, **FLOAT32_NOISE)
