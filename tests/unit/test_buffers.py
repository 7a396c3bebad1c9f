"""BufferPool: KV receive and staging buffers reused across transfers instead of allocated per transfer."""

import pytest
import torch

from phalanx.common.buffers import BufferPool

pytestmark = pytest.mark.unit


def test_a_buffer_given_back_is_lent_again_for_any_shape_and_dtype_that_fits():
    pool = BufferPool(1 << 20)
    first = pool.take((4, 2, 10, 2, 8), torch.float32)
    assert first.shape == (4, 2, 10, 2, 8) and first.dtype == torch.float32 and first.is_contiguous()
    address = first.data_ptr()
    pool.give(first)
    second = pool.take((3, 2, 12, 2, 8), torch.bfloat16)
    assert second.data_ptr() == address and second.dtype == torch.bfloat16 and second.is_contiguous()
    second.fill_(1.5)
    assert torch.equal(second, torch.full((3, 2, 12, 2, 8), 1.5, dtype=torch.bfloat16))


def test_a_lent_buffer_is_not_lent_twice_and_larger_transfers_get_their_own():
    pool = BufferPool(1 << 20)
    a = pool.take((1024,), torch.float32)
    b = pool.take((1024,), torch.float32)
    assert a.data_ptr() != b.data_ptr()
    pool.give(a)
    big = pool.take((4096,), torch.float32)  # 16 KiB: the 4 KiB buffer given back does not fit
    assert big.data_ptr() != a.data_ptr() and big.numel() == 4096


def test_kept_bytes_stay_within_the_limit_and_reserve_touches_a_buffer_ahead():
    pool = BufferPool(64 << 10)
    pool.reserve(40 << 10)
    assert 40 << 10 <= pool.free_bytes <= 64 << 10
    reserved = pool.take((10 << 10,), torch.float32)
    assert pool.free_bytes == 0
    pool.give(reserved)
    pool.give(pool.take((100 << 10,), torch.uint8))  # over the limit on its own: dropped
    assert pool.free_bytes <= 64 << 10
    assert pool.take((0, 5), torch.float32).shape == (0, 5)
