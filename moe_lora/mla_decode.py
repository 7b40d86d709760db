"""Decoding DeepSeek-V3's multi-head latent attention (MLA) with a cache of expanded keys and values.

transformers' `DeepseekV3Attention` caches each token's compressed latent (c_kv, k_rope) and, at every decode
step, expands the whole cache through kv_b_proj:

    K_s = [W_UK c_s ; k_rope_s],   V_s = W_UV c_s   for every cached position s,

so the t-th new token costs t expansions and a response of L tokens O(L^2) of them: on the default tiny
run that was 40% of generation time. `ExpandedKVCache` keeps K_s and V_s instead, expanded once when token s
arrives (the same kv_b_proj, LoRA included, on the new tokens only); attention then reads them as it
reads any key/value cache. Each row's expansion is the same row product as before, so generation samples
what it sampled (tests/test_mla_decode.py compares tokens and logprobs with transformers' path).

Memory per token and layer: H x (d_nope + d_rope + d_v) values against kv_lora_rank + d_rope for the latent.
`expanded_cache_fits` says whether the expanded cache is no larger (the tiny models: 256 against 576); for
DeepSeek-V3's own shape (128 heads: 40,960 against 576) the torch engine keeps transformers' latent cache.
"""

from __future__ import annotations

import functools

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
    DeepseekV3Attention,
    apply_rotary_pos_emb,
    apply_rotary_pos_emb_interleave,
    eager_attention_forward,
)


class ExpandedKVCache(DynamicCache):
    """A DynamicCache whose layers hold expanded MLA keys [B, H, S, d_nope + d_rope] and values [B, H, S, d_v],
    each in a buffer with room for `reserve` more positions (`ReservedLayer`)."""

    def __init__(self, reserve: int = 0):
        super().__init__()
        self.layer_class_to_replicate = functools.partial(ReservedLayer, reserve)


class ReservedLayer(DynamicLayer):
    """A DynamicLayer that writes new positions into preallocated buffers instead of concatenating.

    transformers' layer copies the whole cache at every step (torch.cat): O(S) per token. This one writes
    the new positions into buffers [B, H, S + reserve, d] and hands out views of their first S positions, so a
    decode step copies only its own token until the reserve runs out (then one copy into a new buffer with the
    same reserve). Reordering the batch (batch_select_indices after prefill) replaces the cache with a fresh
    tensor, which the next update copies into a new buffer. The values are the concatenation's, bit for bit."""

    def __init__(self, reserve: int):
        super().__init__()
        self.reserve = reserve
        self.buffers: tuple[torch.Tensor, torch.Tensor] | None = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        start = self.get_seq_length()
        end = start + key_states.shape[-2]
        if not self._buffers_hold_cache(end):
            self.buffers = (
                _with_room(self.keys, key_states, end + self.reserve),
                _with_room(self.values, value_states, end + self.reserve),
            )
        keys, values = self.buffers
        keys[:, :, start:end] = key_states
        values[:, :, start:end] = value_states
        self.keys, self.values = keys[:, :, :end], values[:, :, :end]
        return self.keys, self.values

    def _buffers_hold_cache(self, end: int) -> bool:
        """The buffers still back self.keys/values (nothing replaced them) and have room up to `end`."""
        if self.buffers is None:
            return False
        keys, values = self.buffers
        return (
            keys.shape[-2] >= end
            and self.keys.shape[0] == keys.shape[0]
            and self.keys.data_ptr() == keys.data_ptr()
            and self.values.data_ptr() == values.data_ptr()
        )


def _with_room(cached: torch.Tensor, new_states: torch.Tensor, capacity: int) -> torch.Tensor:
    """A [B, H, capacity, d] buffer (B, H, d of new_states) holding `cached` (possibly empty) at its first positions."""
    batch, heads, _, dim = new_states.shape
    buffer = new_states.new_empty(batch, heads, capacity, dim)
    if cached.numel():
        buffer[:, :, : cached.shape[-2]] = cached
    return buffer


def expanded_cache_fits(config) -> bool:
    """True when the expanded cache takes no more memory per token than the latent one:
    H (d_nope + d_rope + d_v) <= kv_lora_rank + d_rope."""
    per_head = config.qk_nope_head_dim + config.qk_rope_head_dim + config.v_head_dim
    return config.num_attention_heads * per_head <= config.kv_lora_rank + config.qk_rope_head_dim


def expanded_cache_forward(
    attn: DeepseekV3Attention, hidden_states, position_embeddings, attention_mask, past_key_values=None, **kwargs
):
    """DeepseekV3Attention.forward, expanding the new tokens before the cache update when the cache is an
    ExpandedKVCache; any other cache (or none: training) goes to transformers' own forward unchanged."""
    if not isinstance(past_key_values, ExpandedKVCache):
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
    query_states = torch.cat((q_pass, q_rot), dim=-1)

    key_states, value_states = attn.expand_kv(kv_nope, k_rot)  # the new tokens only
    key_states, value_states = past_key_values.update(key_states, value_states, attn.layer_idx)

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


def install_expanded_cache(model) -> int:
    """Route every DeepseekV3Attention of `model` through `expanded_cache_forward` (a no-op unless a forward is
    given an ExpandedKVCache; routing twice changes nothing); returns how many attention modules are routed."""
    routed = 0
    for module in model.modules():
        if isinstance(module, DeepseekV3Attention):
            if not isinstance(module.__dict__.get("forward"), functools.partial):
                module.forward = functools.partial(expanded_cache_forward, module)
            routed += 1
    return routed
