"""Shared test data: one tensor of every dtype family the loaders must place exactly."""

from __future__ import annotations

import ml_dtypes
import numpy as np

__all__ = ["every_kind"]


def every_kind(seed: int) -> dict[str, np.ndarray]:
    """Every split dimension is a multiple of 24, so 2-, 3-, 4-, 6- and 8-way splits divide."""
    rng = np.random.default_rng(seed)
    normal = rng.standard_normal
    return {
        "a": normal((48, 24)).astype(np.float32),
        "b": normal((24,)).astype(np.float32),
        "c": normal((24, 48)).astype(np.float16),
        "d": normal((48, 72)).astype(ml_dtypes.bfloat16),
        "e": rng.integers(-(2**31), 2**31, (24, 24)).astype(np.int32),
        "f": rng.integers(0, 256, (48, 24, 24)).astype(np.uint8),  # 3-D, 3-byte runs on a last-dim split
        "g": (normal((24, 48)) + 1j * normal((24, 48))).astype(np.complex64),
        "m": rng.integers(0, 2, (24, 24)).astype(bool),
        "s": np.array(1.5, np.float32),
        "z": np.zeros((0, 24), np.float32),
    }
