"""``safe_open`` over HTTP from a real nginx: a slice is read with ranged GETs for its
own rows only, and matches numpy."""

from __future__ import annotations

import numpy as np
import pytest

import nnx_save

RNG = np.random.default_rng(1)
W = RNG.standard_normal((64, 4096)).astype(np.float32)  # rows 16 KiB apart


@pytest.fixture
def served(nginx):
    nnx_save.save_file({"bias": np.ones(10, np.float32), "w": W}, nginx.root / "lazy.safetensors")
    nginx.clear_log()
    return nginx


def test_slices_over_http_read_only_their_ranges(served):
    url = f"{served.url}/lazy.safetensors"
    with nnx_save.safe_open(url) as f:
        assert f.keys() == ["bias", "w"]
        header_requests = len(served.requests())
        np.testing.assert_array_equal(f.get_slice("w")[10:14, 100:200], W[10:14, 100:200])
        np.testing.assert_array_equal(f.get_tensor("bias"), np.ones(10, np.float32))
        assert f.io.bytes_read == f.io.bytes_needed == 4 * 100 * 4 + 40
    data = served.requests()[header_requests:]
    assert [r.status for r in data] == [206] * 5  # four rows, one bias: ranged GETs only
    assert sum(r.bytes_sent for r in data) < 4 * 100 * 4 + 40 + 5 * 1024  # the ranges, plus HTTP headers
    got = [(k, v.shape) for k, v in nnx_save.iter_tensors(url)]
    assert got == [("bias", (10,)), ("w", (64, 4096))]
