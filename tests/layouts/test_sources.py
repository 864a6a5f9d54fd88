"""read_header over files, directories, lists and HF indexes; hostile files and
indexes; load_file without a target reads with positioned reads only."""

import contextlib
import json
import mmap
import os
import re
import struct
import tracemalloc

import numpy as np
import pytest
from _errors import raises_check
from hypothesis import given, settings
from hypothesis import strategies as st

import nnx_save
from nnx_save import errors

INDEX_NAME = "model.safetensors.index.json"  # the HuggingFace name


def write_raw(path, header: dict | bytes, data: bytes = b"", size: int | None = None):
    raw = header if isinstance(header, bytes) else json.dumps(header, separators=(",", ":")).encode()
    path.write_bytes(struct.pack("<Q", len(raw) if size is None else size) + raw + data)
    return path


def save(path, **tensors):
    nnx_save.save_file(tensors, path)
    return path


def index(directory, weight_map, metadata=None):
    body = {"weight_map": weight_map} if metadata is None else {"metadata": metadata, "weight_map": weight_map}
    (directory / INDEX_NAME).write_text(json.dumps(body))
    return directory / INDEX_NAME


@pytest.fixture
def two_files(tmp_path):
    save(tmp_path / "a.safetensors", w=np.arange(4, dtype=np.float32), b=np.ones(2, np.int8))
    save(tmp_path / "b.safetensors", v=np.full((2, 2), 7, np.uint16))
    return tmp_path


# --- the kinds of source ---------------------------------------------------------------------


def test_single_file(tmp_path):
    path = tmp_path / "m.safetensors"
    nnx_save.save_file({"w": np.zeros((2, 3), np.float32), "b": np.ones(3, np.bool_)}, path, metadata={"k": "v"})
    h = nnx_save.read_header(path)
    assert h.kind == "file" and len(h.files) == 1 and h.files[0].file == str(path)
    assert len(h) == 2 and list(h) == ["w", "b"] and "w" in h and "x" not in h
    assert h["w"].shape == (2, 3) and h["w"].dtype.code == "F32" and h["w"].file == str(path)
    assert h.nbytes == 27 and h.metadata["k"] == "v"
    assert nnx_save.read_header(h) is h
    assert h["w"].end == h["b"].begin and h["b"].end == os.path.getsize(path)


def test_directory_without_index(two_files):
    h = nnx_save.read_header(two_files)
    assert h.kind == "directory" and [os.path.basename(f.file) for f in h.files] == ["a.safetensors", "b.safetensors"]
    assert sorted(h) == ["b", "v", "w"] and os.path.basename(h["v"].file) == "b.safetensors"
    out = nnx_save.load_file(two_files)
    assert out["v"].tolist() == [[7, 7], [7, 7]] and out["w"].tolist() == [0, 1, 2, 3]


def test_list_of_files(two_files):
    h = nnx_save.read_header([two_files / "b.safetensors", str(two_files / "a.safetensors")])
    assert h.kind == "list" and sorted(h) == ["b", "v", "w"]


def test_index(two_files):
    index(two_files, {"w": "a.safetensors", "b": "a.safetensors", "v": "b.safetensors"}, {"total_size": 36, "x": "y"})
    h = nnx_save.read_header(two_files)
    assert h.kind == "index" and sorted(h) == ["b", "v", "w"]
    assert h.metadata["total_size"] == "36" and h.metadata["x"] == "y"
    assert nnx_save.load_file(two_files)["v"].dtype == np.uint16


def test_hf_cache_layout_with_symlinks_into_blobs(tmp_path):
    # huggingface_hub keeps snapshots/<rev>/<file> as symlinks to ../../blobs/<hash>.
    blobs, snap = tmp_path / "blobs", tmp_path / "snapshots" / "rev"
    blobs.mkdir()
    snap.mkdir(parents=True)
    save(blobs / "1111", w=np.arange(3, dtype=np.float32))
    save(blobs / "2222", v=np.arange(2, dtype=np.int64))
    os.symlink("../../blobs/1111", snap / "model-00001-of-00002.safetensors")
    os.symlink("../../blobs/2222", snap / "model-00002-of-00002.safetensors")
    (blobs / "3333").write_text(
        json.dumps({"weight_map": {"w": "model-00001-of-00002.safetensors", "v": "model-00002-of-00002.safetensors"}})
    )
    os.symlink("../../blobs/3333", snap / INDEX_NAME)
    out = nnx_save.load_file(snap)
    assert out["w"].tolist() == [0, 1, 2] and out["v"].tolist() == [0, 1]


# --- hostile indexes -----------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["../../etc/passwd", "../a.safetensors", "sub/../../a.safetensors", "/etc/passwd"])
def test_index_pointing_outside_its_directory(tmp_path, name):
    d = tmp_path / "ckpt"
    d.mkdir()
    save(tmp_path / "a.safetensors", w=np.zeros(1, np.float32))  # exists, but outside
    idx = index(d, {"w": name})
    with raises_check("index", match=re.escape(f"{idx}: file {name!r} points outside the checkpoint directory {d}")):
        nnx_save.read_header(d)


def test_index_pointing_at_a_missing_file(two_files):
    idx = index(two_files, {"w": "a.safetensors", "b": "a.safetensors", "v": "gone.safetensors"})
    with raises_check(
        "index",
        match=re.escape(f"{idx}: names file 'gone.safetensors', which does not exist in {two_files}"),
    ):
        nnx_save.read_header(two_files)


def test_tensor_in_two_files(tmp_path):
    save(tmp_path / "a.safetensors", w=np.zeros(1, np.float32))
    save(tmp_path / "b.safetensors", w=np.ones(1, np.float32))
    idx = index(tmp_path, {"w": "a.safetensors", "x": "b.safetensors"})
    with raises_check(
        "index",
        match=re.escape(
            f"{idx}: tensor 'w' appears in two files: {tmp_path / 'a.safetensors'} and {tmp_path / 'b.safetensors'}"
        ),
    ):
        nnx_save.read_header(tmp_path)


def test_tensor_in_two_files_of_a_directory(tmp_path):
    save(tmp_path / "a.safetensors", w=np.zeros(1, np.float32))
    save(tmp_path / "b.safetensors", w=np.ones(1, np.float32))
    with raises_check("index", match=re.escape(f"{tmp_path}: tensor 'w' appears in two files: ")):
        nnx_save.read_header(tmp_path)


def test_index_places_a_tensor_in_the_wrong_file(two_files):
    idx = index(two_files, {"w": "b.safetensors", "b": "a.safetensors", "v": "b.safetensors"})
    with raises_check(
        "index",
        match=re.escape(f"{idx}: places tensor 'w' in b.safetensors, but it is in {two_files / 'a.safetensors'}"),
    ):
        nnx_save.read_header(two_files)


def test_index_names_a_tensor_no_file_holds(two_files):
    idx = index(two_files, {"w": "a.safetensors", "b": "a.safetensors", "v": "b.safetensors", "ghost": "b.safetensors"})
    with raises_check(
        "index",
        match=re.escape(f"{idx}: names tensor 'ghost' in b.safetensors, which does not hold it"),
    ):
        nnx_save.read_header(two_files)


def test_files_hold_tensors_the_index_does_not_name(two_files):
    idx = index(two_files, {"w": "a.safetensors", "v": "b.safetensors"})
    with raises_check("index", match=re.escape(f"{idx}: files hold tensors the index does not name: ['b']")):
        nnx_save.read_header(two_files)


def test_index_listing_a_tensor_twice(two_files):
    (two_files / INDEX_NAME).write_text(
        '{"weight_map": {"w": "a.safetensors", "b": "a.safetensors", "v": "b.safetensors", "w": "b.safetensors"}}'
    )
    with raises_check(
        "index",
        match=re.escape(f"{two_files / INDEX_NAME}: key 'w' appears more than once in the index JSON"),
    ):
        nnx_save.read_header(two_files)


@pytest.mark.parametrize(
    "content, message",
    [
        (b'{"weight_map": ', "not a valid JSON index: Expecting value: line 1 column 16 (char 15)"),
        (b'{"weight_map": {"w": "a\xff"}}', "not a valid JSON index: 'utf-8' codec can't decode byte 0xff"),
        (b'{"weight_map": {"w": ' + b"1" * 5000 + b"}}", "not a valid JSON index: Exceeds the limit (4300 digits)"),
        (b'[{"weight_map": {}}]', "expected an object with a 'weight_map' of tensor name -> file name"),
        (b'{"metadata": {}}', "expected an object with a 'weight_map' of tensor name -> file name"),
        (b'{"weight_map": {"w": 3}}', "expected an object with a 'weight_map' of tensor name -> file name"),
        (b'{"weight_map": ["a.safetensors"]}', "expected an object with a 'weight_map' of tensor name -> file name"),
    ],
    ids=["truncated", "not-utf8", "huge-int", "array", "no-map", "non-str", "map-is-list"],
)
def test_malformed_index(two_files, content, message):
    (two_files / INDEX_NAME).write_bytes(content)
    with raises_check("index", match=re.escape(f"{two_files / INDEX_NAME}: {message}")):
        nnx_save.read_header(two_files)


def test_directory_with_nothing_to_load(tmp_path):
    with pytest.raises(
        nnx_save.HeaderError,
        match=re.escape(f"{tmp_path}: directory holds neither {INDEX_NAME} nor any *.safetensors file"),
    ):
        nnx_save.read_header(tmp_path)


def test_missing_source(tmp_path):
    with pytest.raises(FileNotFoundError, match=re.escape(f"{tmp_path / 'x'}: no such checkpoint file or directory")):
        nnx_save.read_header(tmp_path / "x")


# --- hostile files, through the file system ------------------------------------------------------


def test_empty_file(tmp_path):
    path = write_raw(tmp_path / "e.safetensors", b"", size=0)
    path.write_bytes(b"")
    with raises_check("too_small", match=re.escape(f"{path}: 0 bytes is shorter than the 8-byte header size prefix")):
        nnx_save.read_header(path)


def test_header_size_larger_than_file(tmp_path):
    path = write_raw(tmp_path / "m.safetensors", {}, size=1 << 40)
    with raises_check(
        "too_large",
        match=re.escape(f"{path}: header size 1099511627776 exceeds the cap of 100000000 bytes"),
    ):
        nnx_save.load_file(path)
    path = write_raw(tmp_path / "m.safetensors", {}, size=4096)
    with raises_check(
        "too_large",
        match=re.escape(f"{path}: header size 4096 at byte 0 runs past the end of the file (10 bytes)"),
    ):
        nnx_save.load_file(path)


def test_truncated_file(tmp_path):
    path = save(tmp_path / "m.safetensors", w=np.arange(16, dtype=np.float32))
    path.write_bytes(path.read_bytes()[:-3])
    with raises_check(
        "file_size",
        match=re.escape(
            f"{path}: tensor data ends at byte 64 of the data section, but the file holds 61 bytes of data"
        ),
    ):
        nnx_save.load_file(path)


def test_not_utf8_on_disk(tmp_path):
    path = write_raw(tmp_path / "m.safetensors", b'{"\xc3\x28":1}')
    with raises_check("encoding", match=re.escape(f"{path}: header is not valid UTF-8 (byte 10")):
        nnx_save.read_header(path)


@pytest.mark.parametrize(
    "shape, offsets, cls",
    [
        ([10**6, 10**6], [0, 8], "byte_length"),
        ([10**6, 10**6], [0, 4 * 10**12], "file_size"),
    ],
)
def test_trillion_element_claims_allocate_nothing(tmp_path, shape, offsets, cls):
    path = write_raw(
        tmp_path / "m.safetensors", {"w": {"dtype": "F32", "shape": shape, "data_offsets": offsets}}, bytes(8)
    )
    for fn in (nnx_save.read_header, nnx_save.load_file):
        tracemalloc.start()
        try:
            with raises_check(cls, match=re.escape(f"{path}: ")):
                fn(path)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert peak < 1 << 20, (fn, peak)


def _reference_file(tmp_path):
    import ml_dtypes

    return save(
        tmp_path / "real.safetensors",
        w=np.arange(6, dtype=np.float32).reshape(2, 3),
        h=np.ones(3, np.float16),
        b=np.array([True, False]),
        e=np.zeros((0, 2), np.int64),
        s=np.array(5, np.int8),
        f4=np.zeros(4, ml_dtypes.float4_e2m1fn),
    )


@pytest.fixture(scope="module")
def real_file_bytes(tmp_path_factory):
    return _reference_file(tmp_path_factory.mktemp("real")).read_bytes()


@settings(max_examples=80)
@given(data=st.data())
def test_mutated_real_files_load_or_raise_a_header_error(tmp_path_factory, real_file_bytes, data):
    blob = bytearray(real_file_bytes)
    for _ in range(data.draw(st.integers(1, 3))):
        (n,) = struct.unpack("<Q", bytes(blob[:8]).ljust(8, b"\0"))
        head = range(min(8 + n, len(blob)))
        op = data.draw(st.sampled_from(["flip", "digit", "truncate", "append", "prefix"]))
        digits = [i for i in head if i >= 8 and chr(blob[i]).isdigit()]
        if op == "flip" and head:
            blob[data.draw(st.sampled_from(head))] ^= 1 << data.draw(st.integers(0, 7))
        elif op == "digit" and digits:  # hit the numbers: shapes and offsets
            blob[data.draw(st.sampled_from(digits))] = data.draw(st.sampled_from(b"0123456789-"))
        elif op == "truncate" and blob:
            del blob[data.draw(st.integers(0, len(blob) - 1)) :]
        elif op == "append":
            blob += bytes(data.draw(st.integers(1, 16)))
        elif op == "prefix" and len(blob) >= 8:
            blob[:8] = struct.pack("<Q", data.draw(st.integers(0, 2**64 - 1)))
    path = tmp_path_factory.getbasetemp() / "mutated.safetensors"
    path.write_bytes(bytes(blob))
    for fn in (nnx_save.read_header, nnx_save.load_file):
        with contextlib.suppress(nnx_save.HeaderError):
            fn(path)


# --- positioned reads -----------------------------------------------------------------------------


def test_load_file_uses_positioned_reads_only(tmp_path, monkeypatch):
    path = save(tmp_path / "m.safetensors", w=np.arange(1000, dtype=np.float32), v=np.arange(10, dtype=np.int8))
    real_pread, preads = os.pread, []

    def pread(*a):
        preads.append(a[1:])
        return real_pread(*a)

    def forbidden(*a, **k):
        raise AssertionError("a sequential read or a mapping")

    monkeypatch.setattr(os, "pread", pread)
    monkeypatch.setattr(os, "read", forbidden)
    monkeypatch.setattr(os, "lseek", forbidden)
    monkeypatch.setattr(mmap, "mmap", forbidden)
    out, report = nnx_save.load_file(path, return_report=True)
    assert out["w"].tolist() == list(range(1000)) and out["v"].tolist() == list(range(10))
    (n,) = struct.unpack("<Q", path.read_bytes()[:8])
    assert preads == [(8, 0), (n, 8)]  # the header: prefix, then JSON; nothing else through os.pread
    assert report.io.requests >= 1 and report.io.bytes_read == 4010


def test_a_local_file_opens_in_one_open_and_one_fstat(tmp_path, monkeypatch):
    # The registry's look at a path (Path.is_dir, exists, os.path.lexists) costs a stat each in a
    # fresh process's open; a plain file is told by the fstat of the descriptor its header is read from.
    path = save(tmp_path / "m.safetensors", w=np.arange(6, dtype=np.float32))
    real_open, opened = os.open, []

    def no_stat(*a, **k):
        raise AssertionError("a stat of the path: the descriptor's fstat says what it is")

    def counted_open(name, *a, **k):
        opened.append(os.fspath(name))
        return real_open(name, *a, **k)

    with monkeypatch.context() as m:  # undone before pytest reports a failure (it stats files too)
        m.setattr(os, "stat", no_stat)
        m.setattr(os, "lstat", no_stat)
        m.setattr(os, "open", counted_open)
        with nnx_save.safe_open(str(path)) as f:
            values = f.get_slice("w")[1:3].tolist()
    assert values == [1.0, 2.0] and opened == [str(path)]
    for spelled in (f"{tmp_path}//m.safetensors", f"{tmp_path}/./m.safetensors"):  # spelled as Path spells it
        assert nnx_save.read_header(spelled).files[0].file == str(path)
    with pytest.raises(errors.SourceNotFoundError, match=re.escape(f"No such file or directory: {tmp_path}/x")):
        nnx_save.safe_open(f"{tmp_path}/x")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(nnx_save.HeaderError, match=re.escape(f"{empty}: directory holds neither")):
        nnx_save.read_header(str(empty))  # a directory still goes to the layouts, which say what it lacks


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("hf")
    nnx_save.save_file({f"t{i}": np.full((64,), i, np.float32) for i in range(3)}, d, max_shard_size=512)
    return d


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(10**30), 10**30) | st.floats() | st.text(max_size=4),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=6,
)


@settings(max_examples=60, deadline=None)
@given(
    metadata=_JSON
    | st.dictionaries(st.just("total_size"), _JSON, min_size=1)
    | st.builds(lambda n: {"total_size": n}, st.integers(0, 10**30))
)
def test_an_index_metadata_that_is_no_object_or_a_bad_total_size_is_refused(hf_dir, metadata):
    """A ``metadata`` list, or a non-numeric ``total_size``, loaded in silence (transformers
    raises on the first and never reads the second); a wrong but whole ``total_size`` loads."""
    index = hf_dir / "model.safetensors.index.json"
    record = json.loads(index.read_text())
    record["metadata"] = metadata
    index.write_text(json.dumps(record))
    size = metadata.get("total_size", 0) if isinstance(metadata, dict) else None
    digits = type(size) is str and size.isascii() and size.isdigit()  # "1234": as some tools write it
    whole = digits or ((type(size) is int or (type(size) is float and size.is_integer())) and size >= 0)
    if metadata is not None and not isinstance(metadata, dict):
        with raises_check(
            "index", match=re.escape(f"{index}: 'metadata' must be an object, found {type(metadata).__name__}")
        ):
            nnx_save.load_file(hf_dir)
    elif isinstance(metadata, dict) and not whole:
        with raises_check("index", match=re.escape(f"{index}: 'metadata'.'total_size' must be a non-negative integer")):
            nnx_save.load_file(hf_dir)
    else:
        assert {float(v[0]) for v in nnx_save.load_file(hf_dir).values()} == {0.0, 1.0, 2.0}


# -- links on the way to an index's files ------------------------------------------------


@settings(max_examples=40, deadline=None)
@given(
    depth=st.integers(1, 3),
    link=st.one_of(st.none(), st.tuples(st.integers(0, 2), st.sampled_from(["inside", "outside"]))),
    file_link=st.booleans(),
    reader=st.sampled_from(["load_file", "safe_open", "iter_tensors"]),
)
def test_an_index_reads_through_no_directory_link_leaving_the_checkpoint(
    tmp_path_factory, depth, link, file_link, reader
):
    """An index naming ``d0/.../x.safetensors``: a file that is itself a link (the HF
    cache's blobs) loads, a directory on the way that links within the checkpoint loads,
    and one that links outside it is refused by every reader, naming the file and where
    the directory leads."""
    from safetensors.numpy import save_file as foreign_save

    root = tmp_path_factory.mktemp("links")
    ck, parts = root / "ck", [f"d{i}" for i in range(depth)]
    ck.mkdir()
    real = ck.joinpath(*parts)
    linked_out = link is not None and link[0] < depth and link[1] == "outside"
    if link is not None and link[0] < depth:
        k, where = link
        target = (root / "elsewhere" if where == "outside" else ck / "real").joinpath(*parts[k + 1 :])
        target.mkdir(parents=True)
        ck.joinpath(*parts[:k]).mkdir(parents=True, exist_ok=True)
        ck.joinpath(*parts[: k + 1]).symlink_to(target.parents[len(parts) - k - 2] if k + 1 < depth else target)
        real = ck.joinpath(*parts)
    real.mkdir(parents=True, exist_ok=True)
    value = np.arange(6, dtype=np.float32)
    if file_link:  # the file itself links out, as the HF cache's snapshot files do
        (root / "blobs").mkdir()
        foreign_save({"a": value}, str(root / "blobs" / "blob"))
        (real / "x.safetensors").symlink_to(root / "blobs" / "blob")
    else:
        foreign_save({"a": value}, str(real / "x.safetensors"))
    relative = "/".join([*parts, "x.safetensors"])
    (ck / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": relative}}))

    def read() -> np.ndarray:
        if reader == "load_file":
            return nnx_save.load_file(ck)["a"]
        if reader == "safe_open":
            with nnx_save.safe_open(ck, framework="numpy") as f:
                return f.get_tensor("a")
        return dict(nnx_save.iter_tensors(ck))["a"]

    if linked_out:
        with raises_check("index", match=re.escape(f"file {relative!r} is in ")) as info:
            read()
        assert "a directory that links outside the checkpoint" in str(info.value)
        assert str(root / "elsewhere") in str(info.value)
    else:
        np.testing.assert_array_equal(read(), value)
