"""benchmarks/sampler_mismatch.py: every variant is a config the loop accepts, with the settings it names."""

import pytest

from allsync.config import parse_config
from benchmarks.sampler_mismatch import VARIANTS, variant_config


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_each_variant_is_a_config_the_loop_accepts(tiny_bf16, name):
    variant = VARIANTS[name]
    config = parse_config(variant_config(str(tiny_bf16), variant, steps=4, eval_every=2))
    assert config.rollout.fp8_linear_kernel == variant.fp8_linear_kernel
    assert config.rollout.kv_cache_dtype == variant.kv_cache_dtype
    quant = config.model.quant.plan()
    assert all(quant.format_of(group) == fmt for group, fmt in (variant.quant or {}).items())
    assert config.run.steps == 4 and (config.algorithm.tis is None) == (variant.tis is None)
