"""A torch tensor as the numpy array of its values (torch is imported only when a tensor
is handed over: a caller that has one has imported torch already). Used by ``convert``
and by loads from a state dict in memory."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from ..errors import ConvertError

__all__ = ["torch_to_numpy"]


def _not_dense(t: Any) -> str | None:
    """What keeps a torch tensor from having a plain array form, or ``None``."""
    import torch

    if t.is_nested:
        return "a nested (ragged) tensor; unbind it in torch first (tensor.unbind())"
    if t.is_meta:
        return f"a meta tensor (shape {list(t.shape)}, {t.dtype}: no data, only a shape), nothing to convert"
    if t.layout != torch.strided:
        return f"a {str(t.layout).removeprefix('torch.')} tensor; make it dense in torch first (tensor.to_dense())"
    if t.is_quantized:
        return f"a quantized tensor ({t.qscheme()}); dequantize it in torch first (tensor.dequantize())"
    return None


def torch_to_numpy(t: Any, key: str, path: Path) -> np.ndarray:
    """The values of dense tensor ``t`` (``key`` of ``path``, for the messages), bfloat16 and
    float8 through their ml_dtypes equivalents.

    Raises:
        ConvertError: a tensor with no plain array form, or a dtype safetensors lacks.
    """
    import ml_dtypes
    import torch

    problem = _not_dense(t)
    if problem:
        raise ConvertError(f"{path}: {key}: {problem}; convert takes dense tensors with data")
    t = t.detach().cpu().resolve_conj().resolve_neg().contiguous()  # lazy conj / neg bits: their values
    views = {torch.bfloat16: (torch.int16, ml_dtypes.bfloat16)}
    float8 = [name for name in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, name)]
    views.update({getattr(torch, name): (torch.uint8, getattr(ml_dtypes, name)) for name in float8})
    if t.dtype in views:
        as_int, np_dtype = views[t.dtype]
        return t.view(as_int).numpy().view(np_dtype)
    try:
        return t.numpy()
    except TypeError as e:
        raise ConvertError(f"{path}: {key}: torch dtype {t.dtype} has no safetensors equivalent here: {e}") from None
