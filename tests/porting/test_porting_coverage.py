"""Coverage: what a mapping fills, what it leaves missing, what the model lacks."""

from __future__ import annotations

import os
import re

import numpy as np
import pytest

import nnx_save
from nnx_save.porting import Rules, coverage, ignore, rename, split

F32 = np.dtype("float32")
FILE = {
    "fc.weight": ((3, 2), F32),
    "qkv.weight": ((2, 6), F32),
    "pooler.dense.weight": ((2, 2), F32),
    "lm_head.weight": ((5, 2), F32),
}
RULES = Rules(
    rename(r"fc\.weight", "fc/kernel"),
    split(r"qkv\.weight", ["q/kernel", "k/kernel", "v/kernel"], axis=1),
    ignore(r"lm_head\.weight"),
)
MODEL = {"fc/kernel": (3, 2), "fc/bias": (2,), "q/kernel": (2, 2), "k/kernel": (2, 2), "head/kernel": (2, 5)}


def test_coverage_sorts_every_path_into_its_place() -> None:
    c = coverage(RULES.mapping(FILE), MODEL)
    assert c.filled == {"fc/kernel": ("fc.weight",), "k/kernel": ("qkv.weight",), "q/kernel": ("qkv.weight",)}
    assert c.missing == ("fc/bias", "head/kernel")
    assert c.unexpected == {"pooler.dense.weight": ("pooler.dense.weight",), "qkv.weight": ("v/kernel",)}
    assert c.ignored == ("lm_head.weight",)
    assert c.mismatched == {} and not c.complete


def test_allow_patterns_move_paths_to_the_allowed_lists() -> None:
    allow = {"allow_missing": [r".*/bias", r"head/.*"], "allow_unexpected": [r"pooler\..*", "v/kernel"]}
    c = coverage(RULES.mapping(FILE), MODEL, **allow)
    assert (c.missing, c.unexpected) == ((), {})
    assert c.allowed_missing == ("fc/bias", "head/kernel")
    assert c.allowed_unexpected == ("pooler.dense.weight", "qkv.weight")
    assert c.complete
    c.check()


def test_allow_patterns_match_whole_names() -> None:
    c = coverage(RULES.mapping(FILE), MODEL, allow_missing="bias")
    assert c.missing == ("fc/bias", "head/kernel")


def test_shapes_are_compared_when_the_model_gives_them() -> None:
    model = {"fc/kernel": (2, 3), "q/kernel": (2, 2), "k/kernel": (2, 2), "v/kernel": (2, 2)}
    c = coverage(RULES.mapping(FILE), model, allow_unexpected=[r"pooler\..*"])
    assert c.mismatched == {"fc/kernel": ((2, 3), (3, 2))}
    message = (
        "1 mismatch between the model and model.safetensors:\n"
        "  `fc/kernel`: shape (2, 3) in the model, (3, 2) from model.safetensors (`fc.weight`)"
    )
    with pytest.raises(nnx_save.ShapeMismatchError, match="^" + re.escape(message) + "$"):
        c.check("model.safetensors")


def test_paths_alone_skip_the_shape_check() -> None:
    c = coverage(
        RULES.mapping(FILE), ["fc/kernel", "q/kernel", "k/kernel", "v/kernel"], allow_unexpected=[r"pooler\..*"]
    )
    assert c.complete and c.mismatched == {}


def test_check_lists_every_problem_in_one_key_error() -> None:
    message = (
        "4 mismatches between the model and the checkpoint:\n"
        "  `fc/bias`: in the model, not in the checkpoint (allow_missing= to keep its value)\n"
        "  `head/kernel`: in the model, not in the checkpoint (allow_missing= to keep its value)\n"
        "  `pooler.dense.weight`: in the checkpoint, goes to `pooler.dense.weight`, which the model does not have\n"
        "  `qkv.weight`: in the checkpoint, goes to `v/kernel`, which the model does not have"
    )
    with pytest.raises(nnx_save.KeyMismatchError, match="^" + re.escape(message) + "$"):
        coverage(RULES.mapping(FILE), MODEL).check()


def test_mapping_and_coverage_from_a_header_read_no_tensor_data(tmp_path) -> None:
    import ml_dtypes

    from nnx_save.porting import shapes_of

    arrays = {k: np.zeros(shape, F32) for k, (shape, _) in FILE.items()}
    arrays["fc.weight"] = np.zeros((3, 2), ml_dtypes.bfloat16)
    nnx_save.save_file(arrays, tmp_path / "model.safetensors")
    header = nnx_save.read_header(tmp_path / "model.safetensors")
    os.truncate(tmp_path / "model.safetensors", 0)  # from here any read of tensor data fails
    with pytest.raises(nnx_save.errors.TruncatedFileError, match=re.escape("(was it truncated while loading?)")):
        nnx_save.load_file(header)  # as a read by the mapping would
    shapes = shapes_of(header)
    assert shapes == {**FILE, "fc.weight": ((3, 2), np.dtype(ml_dtypes.bfloat16))}
    assert shapes_of(header.tensors) == shapes  # the entries themselves
    mapping = RULES.mapping(header)
    assert mapping == RULES.mapping(shapes) and mapping == RULES.mapping(header.tensors)
    assert mapping.assignments["fc/kernel"].dtype == np.dtype(ml_dtypes.bfloat16)
    c = coverage(mapping, MODEL)
    assert c.missing == ("fc/bias", "head/kernel")
