"""The records a small read makes (nnx_save._frozen) behave as the frozen dataclasses they
replaced: no assignment, equality and hash by their compared fields, copy, pickle and
``_replace`` through their ``__init__`` arguments. Generated over every field of each."""

import copy
import pickle
import random

import numpy as np
import pytest

from nnx_save.format._dtypes import DTYPES, DtypeInfo
from nnx_save.format._header import FileHeader, TensorInfo
from nnx_save.load._source import Header, LocalFiles


def _records(r: random.Random) -> list:
    dtype = DTYPES[r.choice(sorted(DTYPES))]
    begin = r.randrange(8, 1000)
    info = TensorInfo(f"t{r.randrange(99)}", dtype, tuple(r.randrange(1, 5) for _ in range(r.randrange(3))), begin,
                      begin + r.randrange(64), f"f{r.randrange(9)}.safetensors")  # fmt: skip
    file = FileHeader(info.file, {info.name: info}, {"format": "np"}, r.randrange(100), r.randrange(10_000))
    return [DtypeInfo("F32", np.dtype(np.float32), 32), dtype, info, file, Header({info.name: info}, {}, (file,))]


@pytest.mark.parametrize("seed", range(20))
def test_a_record_is_frozen_and_round_trips(seed):
    r = random.Random(seed)
    for record in _records(r):
        cls = type(record)
        for name in cls._fields:
            with pytest.raises(AttributeError, match="cannot assign"):
                setattr(record, name, None)
            with pytest.raises(AttributeError, match="cannot delete"):
                delattr(record, name)
        again = pickle.loads(pickle.dumps(record))
        assert again == record and copy.copy(record) == record and copy.deepcopy(record) == record
        assert [getattr(again, n) for n in cls._compared] == [getattr(record, n) for n in cls._compared]
        assert record._replace() == record and record != object()
        name = r.choice([n for n in cls._compared if n in cls._fields])
        other = record._replace(**{name: _another(getattr(record, name))})
        assert other != record and getattr(other, name) != getattr(record, name)
        assert all(getattr(other, n) == getattr(record, n) for n in cls._fields if n != name)
        if cls is not FileHeader and cls is not Header:  # their mappings are unhashable, as a dataclass's were
            assert hash(again) == hash(record)
        shown = repr(record)
        assert shown.startswith(f"{cls.__qualname__}(") and all(f"{n}=" in shown for n in cls._shown or cls._fields)
        with pytest.raises(TypeError, match="no field 'nope'"):
            record._replace(nope=1)


def _another(value):
    if isinstance(value, bool | int):
        return value + 1 if not isinstance(value, bool) else not value
    if isinstance(value, str):
        return value + "x"
    if isinstance(value, tuple):
        return (*value, 7)
    if isinstance(value, dict):
        return {**value, "another": None}
    if isinstance(value, np.dtype):
        return np.dtype(np.int8) if value != np.int8 else np.dtype(np.uint8)
    if isinstance(value, DtypeInfo):
        return DTYPES["I8"] if value.code != "I8" else DTYPES["U8"]
    raise AssertionError(f"no other value for {value!r}")


def test_a_header_keeps_its_placement_out_of_equality_and_repr():
    placement = LocalFiles()
    a, b = Header({}, placement=placement), Header({})
    assert a == b and a.placement is placement and b.placement is not placement
    assert "placement" not in repr(a)
    assert TensorInfo("a", DTYPES["F32"], (2,), 8, 16).nbytes == 8  # computed, not an argument
