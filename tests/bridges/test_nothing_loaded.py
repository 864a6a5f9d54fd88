"""Loads that load nothing: zero tensors into a model that has some is an
error, strict or not, naming what the source holds against what the model wants and
never advising to allow everything; an empty list of files is refused."""

import re

import numpy as np
import pytest
from _nnx_helpers import poison, snapshot
from flax import nnx

import nnx_save
from nnx_save.porting import Rules, rename


def _other_file(tmp_path):
    path = tmp_path / "other.safetensors"
    nnx_save.save_file({"encoder": {"w": np.ones((4, 4), np.float32)}, "head": np.ones(2, np.float32)}, path)
    return path


@pytest.mark.parametrize("strict", [False, True])
def test_another_models_file_is_an_error_naming_both_sides(tmp_path, strict):
    """A non-strict load of another model's file loaded 0 and only warned; a strict one
    advised allow_missing plus allow_unexpected, which would leave the model random."""
    path = _other_file(tmp_path)
    model = poison(nnx.Linear(2, 3, rngs=nnx.Rngs(0)))
    before = snapshot(model)
    wanted = (
        f"{path}: nothing to load, nothing was read or changed: none of the 2 tensors the model wants is in the source\n"
        "  the model wants 2: bias (3,), kernel (2, 3)\n"
        "  the source holds 2: encoder/w (4, 4), head (2,)\n"
        "No name matches: is this the checkpoint of this model?"
    )
    with pytest.raises(nnx_save.LoadError, match=re.escape(wanted)) as caught:
        nnx_save.load_model(model, path, strict=strict)
    assert "allow_" not in str(caught.value)
    assert sorted(caught.value.report.missing) == ["bias", "kernel"] and caught.value.report.loaded == []
    assert all(np.array_equal(before[k], v) for k, v in snapshot(model).items())


def test_a_builder_and_reshaped_tensors_only_are_refused_too(tmp_path):
    path = tmp_path / "wide.safetensors"
    nnx_save.save_file({"kernel": np.ones((2, 5), np.float32), "bias": np.ones(5, np.float32)}, path)
    wanted = "none of the 2 tensors the model wants is in the source with the model's shape (2 with another)"
    with pytest.raises(nnx_save.LoadError, match=re.escape(wanted)) as caught:
        nnx_save.load_model(lambda: nnx.Linear(2, 3, rngs=nnx.Rngs(0)), path)
    assert "The names match but the shapes do not" in str(caught.value)


def test_nnx_state_keys_of_an_older_save_point_to_save_model(tmp_path):
    """``.../value`` keys (an older ``save_file(nnx.state(model))``): the error says
    so and gives the rule that reads them; the rule does."""
    path = tmp_path / "v.safetensors"
    nnx_save.save_file({"kernel/value": np.full((2, 3), 2, np.float32), "bias/value": np.full(3, 5, np.float32)}, path)
    model = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
    with pytest.raises(nnx_save.LoadError, match=re.escape("with '/value' added ('bias/value')")):
        nnx_save.load_model(model, path, strict=True)
    _, report = nnx_save.load_model(poison(model), path, strict=True, rules=Rules(rename(r"(.*)/value", r"\1")))
    assert (
        report.clean
        and np.all(np.asarray(model.kernel.get_value()) == 2)
        and np.all(np.asarray(model.bias.get_value()) == 5)
    )


def test_allowing_every_missing_path_is_the_callers_choice(tmp_path):
    """Declared: every path may be missing. Nothing loads, no error."""
    path = _other_file(tmp_path)
    _, report = nnx_save.load_model(
        nnx.Linear(2, 3, rngs=nnx.Rngs(0)), path, allow_missing=["*"], allow_unexpected=["*"], strict=True
    )
    assert report.loaded == [] and sorted(report.allowed_missing) == ["bias", "kernel"]


@pytest.mark.parametrize("call", ["load_model", "load_file", "read_header"])
def test_an_empty_list_of_files_is_refused(call):
    calls = {
        "load_model": lambda: nnx_save.load_model(nnx.Linear(2, 3, rngs=nnx.Rngs(0)), []),
        "load_file": lambda: nnx_save.load_file([]),
        "read_header": lambda: nnx_save.read_header([]),
    }
    with pytest.raises(nnx_save.OptionError, match=re.escape("source: an empty list of files")):
        calls[call]()


def test_porting_rules_with_a_wrong_target_and_nothing_loaded_name_the_fix_only(tmp_path):
    """Nothing loads because the rules send every key to a path the model lacks: the
    error gives the target fix, and no allow_* option."""
    from nnx_save.porting import torch_layer_norm

    path = tmp_path / "ln.safetensors"
    nnx_save.save_file({"t.ln_f.weight": np.ones(4, np.float32), "t.ln_f.bias": np.ones(4, np.float32)}, path)
    rules = Rules(torch_layer_norm(r"t\.ln_f", "final_norm"))
    wanted = "fix the rules' targets, rather than allowing either:\n  `final_norm/...` -> `ln_f/...`"
    with pytest.raises(nnx_save.LoadError, match=re.escape(wanted)) as caught:
        nnx_save.load_model(nnx.Dict(ln_f=nnx.LayerNorm(4, rngs=nnx.Rngs(0))), path, rules=rules, strict=True)
    assert "allow_" not in str(caught.value)
