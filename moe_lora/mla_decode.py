"""Decoding DeepSeek-V3's multi-head latent attention (MLA) without re-expanding the cache.

transformers' `DeepseekV3Attention` caches each token's compressed latent (c_kv, k_rope) and, at every decode
step, expands the whole cache through kv_b_proj:

    K_s = [W_UK c_s ; k_rope_s],   V_s = W_UV c_s   for every cached position s,

so the t-th new token costs t expansions and a response of L tokens O(L^2) of them. Two caches avoid that
(moe_lora/kv_caches.py); the torch engine takes the smaller per token (`expanded_cache_fits`):

- `ExpandedKVCache` keeps K_s and V_s, expanded once when token s arrives (the same kv_b_proj, LoRA included, on
  the new tokens only): H x (d_nope + d_rope + d_v) values per token and layer. The tiny models: 256 against 576.
- `LatentKVCache` keeps the latent [c_s ; k_rope_s] (kv_lora_rank + d_rope values: 576 for DeepSeek-V3, against
  40,960 expanded) and attends in latent space, as DeepSeek's and vLLM's decoders do ("absorbed" MLA). With
  kv_b_proj's weight split per head h into W_UK_h [d_nope, r] and W_UV_h [d_v, r]:

      score_hs = scaling (q_nope_h W_UK_h . c_s + q_rope_h . k_rope_s)       (q absorbed through W_UK)
      out_h    = W_UV_h sum_s softmax_s(score_h)_s c_s                       (output through W_UV)

  which is MQA with one shared key [c_s ; k_rope_s] of 576 values and value c_s. A LoRA on kv_b_proj
  (W + s B A) enters in factored form, never as a merged W: q_nope_h (W_UK_h + s B_K,h A) = q_nope_h W_UK_h +
  s (q_nope_h B_K,h) A, and likewise (W_UV_h + s B_V,h A) o_h = W_UV_h o_h + s B_V,h (A o_h). LoRA on q_b_proj,
  q_a_proj and kv_a_proj_with_mqa acts on the new tokens before the cache, as in any forward. A prefill into an
  empty cache attends to its own tokens expanded (MHA through SDPA, as DeepSeek's and vLLM's prefill do: fewer
  FLOPs and no [H x T x T] scores); every later step attends to the cache in latent space.

Both give what transformers' path gives to float rounding (tests/allsync/engines/test_rollout_trainer.py compares
tokens and logprobs, on the tiny model and on two random layers of DeepSeek-V3's head dims).
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
    DeepseekV3Attention,
    apply_rotary_pos_emb,
    apply_rotary_pos_emb_interleave,
    eager_attention_forward,
)

from moe_lora.kv_caches import ExpandedKVCache, LatentKVCache, SlotKVCache
from moe_lora.latent_attention import latent_decode_attention
from moe_lora.lora_layers import LoRALinear
from quant.modules import FrozenLinear


def mla_decode_forward(
    attn: DeepseekV3Attention, hidden_states, position_embeddings, attention_mask, past_key_values=None, **kwargs
):
    """DeepseekV3Attention.forward for the two decode caches (module docstring); any other cache (or none:
    training) goes to transformers' own forward unchanged."""
    if not isinstance(past_key_values, (ExpandedKVCache, LatentKVCache, SlotKVCache)):
        return DeepseekV3Attention.forward(
            attn, hidden_states, position_embeddings, attention_mask, past_key_values, **kwargs
        )
    batch_size, seq_length = hidden_states.shape[:-1]
    if attn.q_lora_rank is None:
        q_states = attn.q_proj(hidden_states)
    else:
        q_states = attn.q_b_proj(attn.q_a_layernorm(attn.q_a_proj(hidden_states)))
    q_states = q_states.view(batch_size, seq_length, -1, attn.qk_head_dim).transpose(1, 2)
    q_pass, q_rot = torch.split(q_states, [attn.qk_nope_head_dim, attn.qk_rope_head_dim], dim=-1)

    kv_nope, k_rot = torch.split(
        attn.kv_a_proj_with_mqa(hidden_states), [attn.kv_lora_rank, attn.qk_rope_head_dim], dim=-1
    )
    kv_nope = attn.kv_a_layernorm(kv_nope).view(batch_size, 1, seq_length, attn.kv_lora_rank)
    k_rot = k_rot.view(batch_size, 1, seq_length, attn.qk_rope_head_dim)
    cos, sin = position_embeddings
    rotate = apply_rotary_pos_emb_interleave if attn.config.rope_interleave else apply_rotary_pos_emb
    q_rot, k_rot = rotate(q_rot, k_rot, cos, sin)

    slots = isinstance(past_key_values, SlotKVCache)  # a decode step of the live slots, each at its own length
    if slots and past_key_values.kernel:  # each slot's own positions as stored (moe_lora.latent_attention)
        layer = past_key_values.layers[attn.layer_idx]
        layer.append(torch.cat((kv_nope, k_rot), dim=-1), kv_nope[..., :0])
        query, up_v = absorbed_query(attn, q_pass, q_rot)
        out_latent = latent_decode_attention(
            query[:, :, 0],
            *layer.stored_latent(attn.kv_lora_rank),
            past_key_values.counts,
            attn.scaling,
            past_key_values.span,
            table=past_key_values.table[:batch_size],
            page=past_key_values.page,
        )
        attn_output = up_v.expand(out_latent[:, :, None]).transpose(1, 2).reshape(batch_size, seq_length, -1)
        return attn.o_proj(attn_output), None
    if isinstance(past_key_values, LatentKVCache) or (slots and past_key_values.latent):
        cached = past_key_values.get_seq_length(attn.layer_idx)
        latent = torch.cat((kv_nope, k_rot), dim=-1)
        latent, _ = past_key_values.update(latent, latent[..., :0], attn.layer_idx)
        if cached or slots:  # attend to the cache in latent space
            mask = past_key_values.mask if slots else attention_mask
            attn_output = absorbed_attention(attn, q_pass, q_rot, latent, mask, cached)
            attn_output = attn_output.transpose(1, 2).reshape(batch_size, seq_length, -1)
            return attn.o_proj(attn_output), None
        key_states, value_states = attn.expand_kv(kv_nope, k_rot)  # a prefill: its own tokens, expanded
    else:
        key_states, value_states = attn.expand_kv(kv_nope, k_rot)  # the new tokens only
        key_states, value_states = past_key_values.update(key_states, value_states, attn.layer_idx)
        if slots:
            attention_mask = past_key_values.mask

    query_states = torch.cat((q_pass, q_rot), dim=-1)
    attention = ALL_ATTENTION_FUNCTIONS.get_interface(attn.config._attn_implementation, eager_attention_forward)
    attn_output, attn_weights = attention(
        attn,
        query_states,
        key_states,
        value_states,
        attention_mask,
        dropout=0.0 if not attn.training else attn.attention_dropout,
        scaling=attn.scaling,
        **kwargs,
    )
    attn_output = attn_output.reshape(batch_size, seq_length, -1).contiguous()
    return attn.o_proj(attn_output), attn_weights


def absorbed_attention(attn: DeepseekV3Attention, q_nope, q_rot, latent, attention_mask, cached: int) -> torch.Tensor:
    """MLA in latent space (module docstring): q_nope [B, H, T, d_nope], q_rot [B, H, T, d_rope] (rotated), latent
    [B, 1, S, r + d_rope] (the cache, these T tokens last) -> [B, H, T, d_v].

    The H heads share the key, so heads and new tokens fold into one batched product: [B, H T, r + d_rope] x
    [B, r + d_rope, S], scaled in the product's epilogue (baddbmm's alpha) and written once in the compute dtype;
    the mask is applied in place and softmax (accumulating in float32) writes the weights in the compute dtype: a
    decode step moves 12 H bytes a cached position for its scores in bf16 (written, masked, softmaxed, read), not the
    40 H that float32 scores moved. attention_mask is transformers' (a boolean or additive [B, 1, T, S] mask) or None, then
    token t sees the `cached` positions and the new ones up to itself."""
    batch, heads, new, _ = q_nope.shape
    rank = attn.kv_lora_rank
    query, up_v = absorbed_query(attn, q_nope, q_rot)
    query = query.reshape(batch, heads * new, -1)
    keys = latent.squeeze(1)
    unused = query.new_zeros(1, 1, 1)  # beta = 0: baddbmm does not read it
    scores = torch.baddbmm(unused, query, keys.transpose(1, 2), beta=0, alpha=attn.scaling)
    scores = scores.view(batch, heads, new, -1)
    if attention_mask is None and new > 1:
        span = torch.arange(keys.shape[1], device=keys.device)
        attention_mask = span[None, :] <= cached + torch.arange(new, device=keys.device)[:, None]
    if attention_mask is not None and attention_mask.dtype == torch.bool:
        scores = scores.masked_fill_(~attention_mask, float("-inf"))
    elif attention_mask is not None:
        scores = scores.add_(attention_mask.to(scores.dtype))
    probs = torch.softmax(scores, dim=-1).view(batch, heads * new, -1)
    out_latent = torch.bmm(probs, keys[..., :rank]).view(batch, heads, new, rank)
    return up_v.expand(out_latent)


def absorbed_query(attn: DeepseekV3Attention, q_nope, q_rot) -> tuple[torch.Tensor, "HeadProjection"]:
    """([q_nope W_UK ; q_rot] [B, H, T, r + d_rope], W_UV's HeadProjection): the query in latent space and what takes
    the attention's latent output back to values (module docstring)."""
    up_k, up_v = kv_b_factors(attn, q_nope.dtype)
    return torch.cat((up_k.absorb(q_nope), q_rot), dim=-1), up_v


class HeadProjection:
    """One half of kv_b_proj per head: W [H, d, r] (W_UK with d = d_nope, or W_UV with d = d_v) and, with a LoRA on
    kv_b_proj, its rows of B [H, d, rank], the shared A [rank, r] and the scale s."""

    def __init__(self, weight: torch.Tensor, lora: tuple[torch.Tensor, torch.Tensor, float] | None):
        self.weight, self.lora = weight, lora

    def absorb(self, q: torch.Tensor) -> torch.Tensor:
        """q [B, H, T, d] -> q (W + s B A) [B, H, T, r]: q W + s (q B) A."""
        out = torch.einsum("bhtd,hdr->bhtr", q, self.weight)
        if self.lora is not None:
            a, b, scale = self.lora
            out = out.add_(torch.einsum("bhtd,hdk->bhtk", q, b).mul_(scale) @ a)
        return out

    def expand(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, H, T, r] -> (W + s B A) x [B, H, T, d]: W x + s B (A x)."""
        out = torch.einsum("bhtr,hdr->bhtd", x, self.weight)
        if self.lora is not None:
            a, b, scale = self.lora
            out = out.add_(torch.einsum("bhtk,hdk->bhtd", (x @ a.T).mul_(scale), b))
        return out


def kv_b_factors(attn: DeepseekV3Attention, dtype: torch.dtype) -> tuple[HeadProjection, HeadProjection]:
    """kv_b_proj's W_UK and W_UV per head (views of its weight, in `dtype`), each with its rows of kv_b_proj's LoRA
    when it has one that is on (`kv_b_weight`)."""
    weight, lora = kv_b_weight(attn, dtype)
    heads, nope, v = attn.num_heads, attn.qk_nope_head_dim, attn.v_head_dim
    weight = weight.to(dtype).view(heads, nope + v, attn.kv_lora_rank)
    if lora is None:
        return HeadProjection(weight[:, :nope], None), HeadProjection(weight[:, nope:], None)
    a, b, scale = lora
    b = b.view(heads, nope + v, -1)
    return HeadProjection(weight[:, :nope], (a, b[:, :nope], scale)), HeadProjection(
        weight[:, nope:], (a, b[:, nope:], scale)
    )


def kv_b_weight(attn: DeepseekV3Attention, dtype: torch.dtype):
    """(W [H (d_nope + d_v), r], (A, B, s) or None) of kv_b_proj: a LoRALinear gives its frozen W and its factors
    (its merged W + s B A alone when generation formed one; W alone when adapters are off), a FrozenLinear its
    dequantized W, an nn.Linear its weight. Any other module there is refused by name: the latent path could not
    apply it."""
    module, lora = attn.kv_b_proj, None
    if isinstance(module, LoRALinear):
        if module.enabled and module.merged is not None:
            return module.merged, None
        if module.enabled:
            lora = (module.lora_A.to(dtype), module.lora_B.to(dtype), module.scale)
        module = module.base
    if isinstance(module, FrozenLinear):
        return module.weight_q.dequantize(dtype), lora
    if isinstance(module, nn.Linear):
        return module.weight, lora
    raise TypeError(
        f"model.layers.{attn.layer_idx}.self_attn.kv_b_proj is a {type(module).__name__}: MLA's latent decode "
        "applies nn.Linear, FrozenLinear and LoRALinear only"
    )


def install_mla_decode(model) -> int:
    """Route every DeepseekV3Attention of `model` through `mla_decode_forward` (a no-op unless a forward is given
    one of this module's caches; routing twice changes nothing); returns how many attention modules are routed."""
    routed = 0
    for module in model.modules():
        if isinstance(module, DeepseekV3Attention):
            if not isinstance(module.__dict__.get("forward"), functools.partial):
                module.forward = functools.partial(mla_decode_forward, module)
            routed += 1
    return routed
