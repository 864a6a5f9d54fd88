"""Porting: bring PyTorch / HuggingFace checkpoints into NNX models, and back.

Rules are plain data (frozen dataclasses); planning is pure numpy and never imports
torch or jax.

Rule kinds (constructors in :mod:`nnx_save.porting`):

- ``rename(pattern, replacement)``: a file key matching ``pattern`` (a regex,
  ``re.fullmatch``) becomes the model path ``replacement`` (``\\1`` / ``\\g<name>``
  references). The first matching rename wins; a key no rule matches keeps its name.
- ``split(pattern, targets, axis, sizes=None)``: one file tensor cut into several
  model params (a fused qkv); equal parts unless ``sizes`` is given.
- ``concat(patterns, target, axis, sizes=None)``: several file tensors joined.
- ``stack(pattern, target, axis=0)``: per-layer file tensors stacked into one param
  (scanned layers); the layer index is the named group ``(?P<layer>\\d+)``.
- ``unstack(pattern, target, axis=0)``: the reverse; ``target`` uses ``\\g<layer>``.
- ``split(..., stacked=True)``: each layer's tensor cut, each part stacked over the
  layers (separate q / k / v in a scanned model).
- ``add(patterns, targets, axis=0, into=0)``: file tensors summed (torch's two LSTM
  biases); on export the sum goes to part ``into``, zeros to the others.
- ``tie(source, *copies, check=True)``: tied copies of one file tensor (a tied head):
  checked equal on load, all written on export.
- ``ignore(pattern)``: file tensors dropped on purpose (a buffer).
- ``transpose(pattern, axes)`` and ``reshape(pattern, shape, source_shape=None)``:
  value transforms selected by a regex on the **model path**.

A file key may feed only one rule (renames excepted: the first wins; a key matched
by a rename and another kind of rule is a conflict), and a target may be made only
once: both are :class:`RuleConflictError`, naming both sides.

The contract the loader calls::

    mapping = rules.mapping({file_key: (shape, dtype), ...})      # pure, no I/O
    mapping.assignments: dict[target_path, Assignment]
        Assignment(target, sources: tuple[str, ...], shape, dtype, transform)
        transform is None  -> the target is exactly sources[0], only renamed:
                              read it straight from the file (sharded).
        otherwise          -> transform(list_of_source_arrays) -> np.ndarray, a pure
                              callable (frozen dataclass, no pickle, no closure),
                              applied one target at a time.
    mapping.landed: dict[file_key, tuple[target_path, ...]]    # () = landed nowhere
    mapping.unused: tuple[file_key, ...]                       # dropped by ignore rules
    mapping.tied: dict[copy_key, source_key]                   # tie rules' copies found

Export uses the same contract the other way: ``rules.inverse().mapping(model_shapes)``
maps model paths to file keys with the inverse transforms (rename inverted from the
regex, transpose by the inverse permutation, split <-> concat, stack <-> unstack,
reshape back to the recorded source shape).

:func:`coverage` compares a mapping with the model's expected paths: what was filled
from where, what is missing, which file tensors are unexpected.

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
    "NotInvertibleError",
    "RenameRule",
    "Reshape",
    "ReshapeRule",
    "RuleConflictError",
    "RuleError",
    "RuleShapeError",
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
    "TiedValuesError",
    "Transform",
    "Transpose",
    "TransposeRule",
    "UnstackRule",
    "add",
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
    "torch_embedding",
    "torch_layer_norm",
    "torch_linear",
    "torch_lstm",
    "torch_rms_norm",
    "transpose",
    "unstack",
]

from ..errors import NotInvertibleError, RuleConflictError, RuleError, RuleShapeError, TiedValuesError
from ._compose import ConcatUnstackRule, SplitStackRule, SumExportRule, SumRule, TieRule
from ._constructors import add, concat, ignore, rename, reshape, split, stack, tie, transpose, unstack
from ._coverage import Coverage, coverage
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
from ._mapping import Assignment, KeyMapping, Rules, shapes_of
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
from ._transforms import (
    Chain,
    Concatenate,
    Constant,
    Each,
    Index,
    Reshape,
    Same,
    Stack,
    Sum,
    Take,
    Transform,
    Transpose,
)
