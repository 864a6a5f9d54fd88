"""Porting: bring PyTorch / HuggingFace checkpoints into NNX models, and back.

Rules are plain data (frozen dataclasses, one constructor per kind: ``rename``,
``split``, ``concat``, ``stack``, ``unstack``, ``add``, ``tie``, ``ignore``, ``transpose``,
``reshape``, ``compute`` (a function with a declared inverse; ``weight_norm`` is built on it),
and the ``torch_*`` / ``hf_conv1d`` helpers); ``rules.mapping(shapes)`` plans
the port in pure numpy, never importing torch or jax, and ``rules.inverse()`` gives the
export (``rules.inverse(source=path)``: one that reproduces the source file byte for byte).
A file key feeds one rule and a target is made once, else :class:`RuleError`; the
table as a whole is checked too (a rule given twice, two transposes on one tensor, a rule
that matches nothing or is shadowed: ``mapping.problems``, refused as
:class:`RuleError` under ``strict``, else a :class:`RuleTableWarning`).
``Rules(..., prefix="module.")`` strips and restores a prefix every key carries.
docs/porting.md is the reference: the rule table, the mapping contract, coverage, export.

Examples:
    >>> import numpy as np
    >>> from nnx_save.porting import Rules, rename, split, torch_linear
    >>> rules = Rules(
    ...     split(r"h\\.(\\d+)\\.qkv\\.weight", (r"h/\\1/q/kernel", r"h/\\1/k/kernel"), axis=1),
    ...     torch_linear(r"h\\.(\\d+)\\.out", r"h/\\1/out", bias=False),
    ... )
    >>> f32 = np.dtype("float32")
    >>> mapping = rules.mapping({"h.0.qkv.weight": ((3, 8), f32), "h.0.out.weight": ((5, 3), f32)})
    >>> sorted(mapping.assignments)
    ['h/0/k/kernel', 'h/0/out/kernel', 'h/0/q/kernel']
    >>> mapping.landed["h.0.qkv.weight"]
    ('h/0/k/kernel', 'h/0/q/kernel')
    >>> mapping.assignments["h/0/out/kernel"].shape
    (3, 5)
"""

__all__ = [
    "TORCH_LINEAR_AXES",
    "Assignment",
    "Chain",
    "ComputeExportRule",
    "ComputeRule",
    "Computed",
    "ComputedPart",
    "ConcatRule",
    "ConcatUnstackRule",
    "Concatenate",
    "Constant",
    "ConstantRule",
    "Coverage",
    "Each",
    "IgnoreRule",
    "Index",
    "KeyMapping",
    "RenameRule",
    "Reshape",
    "ReshapeRule",
    "Restore",
    "RuleError",
    "RuleKind",
    "RuleTableWarning",
    "Rules",
    "Same",
    "SplitRule",
    "SplitStackRule",
    "Stack",
    "StackRule",
    "Sum",
    "SumExportRule",
    "SumRule",
    "Take",
    "TieRule",
    "Transform",
    "Transpose",
    "TransposeRule",
    "UnstackRule",
    "add",
    "compute",
    "concat",
    "coverage",
    "hf_conv1d",
    "ignore",
    "rename",
    "reshape",
    "shapes_of",
    "split",
    "stack",
    "tie",
    "torch_batch_norm",
    "torch_conv",
    "torch_conv_axes",
    "torch_conv_transpose",
    "torch_embedding",
    "torch_group_norm",
    "torch_gru",
    "torch_layer_norm",
    "torch_linear",
    "torch_lstm",
    "torch_rms_norm",
    "torch_weight_norm",
    "transpose",
    "unstack",
    "weight_norm",
]

from ._compose import ConcatUnstackRule, SplitStackRule, SumExportRule, SumRule, TieRule
from ._compute_steps import Computed, ComputedPart
from ._computed import ComputeExportRule, ComputeRule, compute
from ._constructors import add, concat, ignore, rename, reshape, split, stack, tie, transpose, unstack
from ._coverage import Coverage, coverage
from ._errors import RuleError, RuleKind, RuleTableWarning
from ._hf import (
    TORCH_LINEAR_AXES,
    hf_conv1d,
    torch_batch_norm,
    torch_conv,
    torch_conv_axes,
    torch_embedding,
    torch_layer_norm,
    torch_linear,
    torch_lstm,
    torch_rms_norm,
)
from ._mapping import Assignment, KeyMapping, Rules
from ._rules import (
    ConcatRule,
    ConstantRule,
    IgnoreRule,
    RenameRule,
    ReshapeRule,
    SplitRule,
    StackRule,
    TransposeRule,
    UnstackRule,
)
from ._shapes import shapes_of
from ._torch_layers import torch_conv_transpose, torch_group_norm, torch_gru
from ._transforms import (
    Chain,
    Concatenate,
    Constant,
    Each,
    Index,
    Reshape,
    Restore,
    Same,
    Stack,
    Sum,
    Take,
    Transform,
    Transpose,
)
from ._weight_norm import torch_weight_norm, weight_norm
