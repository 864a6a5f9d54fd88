"""Every integer read from outside is bounded before it sizes anything: a key's layer
index (stack rules: ``h.99999999999.w`` once built a set of 10^11 ints), a file's axis
length that a rule splits into params (unstack of a zero-byte ``(10^15, 0)`` tensor), a
header's shape fields, and each ``NNX_SAVE_*`` integer variable. Generated over
integers up to 10^30 (and 400 digits), under an address-space cap of 2 GiB over what the
process maps: each either works or is a typed refusal; none is a MemoryError, an
OverflowError or a hang."""

from __future__ import annotations

import re
import struct

import numpy as np
import pytest
from _limits import address_space_over
from hypothesis import given, settings
from hypothesis import strategies as st

import nnx_save
from nnx_save import _config
from nnx_save.errors import ConfigError
from nnx_save.format._header import parse_header
from nnx_save.porting import RuleError, Rules, rename, stack, unstack
from nnx_save.porting._parts import MAX_INDEX_DIGITS, MAX_LAYERS

HUGE = st.one_of(st.integers(0, 12), st.integers(0, 10**30), st.sampled_from([99999999999, 2**63, 2**64 + 1]))
CAP = 2 << 30


@settings(max_examples=80)
@given(indices=st.sets(HUGE, min_size=1, max_size=5))
def test_a_stack_rule_bounds_layer_indices_from_keys(indices):
    sources = {f"h.{i}.w": ((2,), np.float32) for i in indices}
    rules = Rules(stack(r"h\.(?P<layer>\d+)\.w", "layers/w"))
    with address_space_over(CAP):
        try:
            mapping = rules.mapping(sources)
        except RuleError as e:
            assert indices != set(range(len(indices)))
            if max(indices) >= 10**MAX_INDEX_DIGITS:
                assert f"at most {MAX_INDEX_DIGITS} digits" in str(e)
                return
            listed = re.search(r"missing layers \[([^\]]*)\]", str(e))
            assert listed is not None and len(listed[1].split(",")) <= 8, str(e)
            return
    assert indices == set(range(len(indices)))
    assert list(mapping.assignments) == ["layers/w"]


@pytest.mark.parametrize(
    "rule",
    [
        stack(r"h\.(?P<layer>\d+)\.w", "layers/w"),
        rename(r"h\.(\d+)\.w", r"l/\1/w", shift={1: -1}),
        rename(r"h\.(\d+)\.w", r"l/\1/w", index={1: [0, 3]}),
    ],
    ids=["stack", "shift", "index"],
)
@pytest.mark.parametrize("digits", [19, 4301, 5000])
def test_an_index_of_thousands_of_digits_is_refused(rule, digits):
    """int() itself refuses 4,300 digits (a bare ValueError): the rules refuse first."""
    sources = {"h.0.w": ((2,), np.float32), f"h.{'9' * digits}.w": ((2,), np.float32)}
    with pytest.raises(RuleError, match=f"at most {MAX_INDEX_DIGITS}"):
        Rules(rule).mapping(sources)


@settings(max_examples=60)
@given(n=HUGE)
def test_an_unstack_rule_bounds_the_axis_it_splits(n):
    """A zero-byte tensor may claim any length on an axis: it sizes no params past the bound."""
    rules = Rules(unstack(r"w", r"layers/\g<layer>/w"))
    with address_space_over(CAP):
        try:
            mapping = rules.mapping({"w": ((n, 0), np.float32)})
        except RuleError as e:
            assert n > MAX_LAYERS and f"an axis of {n}" in str(e)
            return
    assert n <= MAX_LAYERS and len(mapping.assignments) == n


@settings(max_examples=60)
@given(dims=st.lists(HUGE, min_size=1, max_size=3))
def test_header_shape_fields_are_bounded(tmp_path_factory, dims):
    """A header's shape is parsed or refused (HeaderError); a zero-size tensor of any
    claimed shape loads as such, nothing allocated by its dims."""
    shape = [*dims, 0] if dims[0] > 8 else dims
    nbytes = int(np.prod(shape, dtype=object)) * 4
    if nbytes > 64:
        return
    head = f'{{"w":{{"dtype":"F32","shape":{list(shape)},"data_offsets":[0,{nbytes}]}}}}'.encode()
    head += b" " * (-len(head) % 8)
    path = tmp_path_factory.mktemp("h") / "w.safetensors"
    path.write_bytes(struct.pack("<Q", len(head)) + head + bytes(nbytes))
    with address_space_over(CAP):
        try:
            parse_header(head, len(head) + 8 + nbytes)
        except nnx_save.HeaderError:
            return
        got = nnx_save.load_file(path)["w"]
    assert list(got.shape) == shape


INTEGER_VARIABLES = [
    v for v in vars(_config).values() if isinstance(v, _config.Variable) and isinstance(v.default, int)
]


@pytest.mark.parametrize("variable", INTEGER_VARIABLES, ids=lambda v: v.name)
@settings(max_examples=30)
@given(text=st.one_of(HUGE.map(str), HUGE.map(lambda i: f"-{i}"), st.just("9" * 400), st.just("0" * 30 + "7")))
def test_integer_variables_are_bounded(variable, text):
    try:
        with pytest.MonkeyPatch.context() as env:
            env.setenv(variable.name, text)
            value = variable.get()
    except ConfigError as e:
        assert variable.name in str(e)
        return
    assert isinstance(value, int) and 0 <= value <= 1 << 62 and value == int(text)
