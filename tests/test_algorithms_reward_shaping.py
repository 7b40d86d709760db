import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from allsync.algorithms import overlong_filter_mask, overlong_penalty


def test_dapo_paper_oracle():
    lengths = torch.tensor([16384, 18432, 20480, 20481, 1000])
    penalty = overlong_penalty(lengths, max_len=20480, cache_len=4096)
    assert penalty.tolist() == [0.0, -0.5, -1.0, -1.0, 0.0]


def test_factor_scales_and_list_input():
    assert overlong_penalty([17408, 30000], max_len=20480, cache_len=4096, factor=2.0).tolist() == [-0.5, -2.0]


def test_zero_cache_len_is_a_hard_cutoff():
    assert overlong_penalty([10, 11], max_len=10, cache_len=0).tolist() == [0.0, -1.0]


def test_invalid_cache_len():
    with pytest.raises(ValueError, match="cache_len"):
        overlong_penalty([1], max_len=10, cache_len=11)


@settings(max_examples=100, deadline=None)
@given(
    st.integers(1, 5000),
    st.data(),
    st.floats(0.0, 5.0, allow_nan=False),
)
def test_property_monotone_and_bounded(max_len, data, factor):
    cache_len = data.draw(st.integers(0, max_len))
    lengths = torch.tensor(sorted(data.draw(st.lists(st.integers(0, 2 * max_len + 5), min_size=1, max_size=50))))
    penalty = overlong_penalty(lengths, max_len, cache_len, factor)
    assert bool((penalty[1:] <= penalty[:-1]).all())
    assert bool((penalty >= -factor - 1e-6).all()) and bool((penalty <= 0).all())


def test_overlong_filter_mask_zeroes_truncated_rows():
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0]])
    out = overlong_filter_mask(["stop", "length", "stop"], mask)
    assert out.tolist() == [[1, 1, 0], [0, 0, 0], [1, 0, 0]]
    assert out.dtype == mask.dtype
    assert mask[1].tolist() == [1, 1, 1]  # input untouched
    with pytest.raises(ValueError):
        overlong_filter_mask(["stop"], mask)
