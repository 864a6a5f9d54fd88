"""The storage layer's contract, the same for a local directory and an object-store
prefix (fsspec's in-memory store): list, read records and byte ranges, commit staged
data files and then one record atomically, remove, lock; an HTTP prefix is read-only.
Names and contents are drawn by hypothesis."""

from __future__ import annotations

import os
import re
import uuid
from pathlib import Path

import fsspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from nnx_save.errors import DirectoryLockedError, HeaderError, SaveError
from nnx_save.io import _storage
from nnx_save.io._atomic import TMP_MARKER, atomic_file, host_name

MEMORY = fsspec.filesystem("memory")
NAMES = st.from_regex(r"[a-z][a-z0-9_.-]{0,20}", fullmatch=True).filter(lambda n: TMP_MARKER not in n)
FILES = st.dictionaries(NAMES, st.binary(max_size=300), min_size=1, max_size=5)


def _fresh(kind: str, tmp: Path) -> _storage.Location:
    """A location that does not exist yet, of ``kind``."""
    if kind == "local":
        return _storage.locate(tmp / uuid.uuid4().hex / "ck")
    return _storage.locate(f"memory://nnx-save-storage-{uuid.uuid4().hex[:12]}/ck")


KINDS = pytest.mark.parametrize("kind", ["local", "object"])


def test_locate_tells_a_path_from_a_url_by_its_scheme(tmp_path):
    assert isinstance(_storage.locate(tmp_path), _storage.LocalDirectory)
    assert isinstance(_storage.locate("relative/dir"), _storage.LocalDirectory)
    assert isinstance(_storage.locate("HTTPS://host/dir"), _storage.HttpPrefix)
    assert isinstance(_storage.locate("s3://bucket/run"), _storage.ObjectPrefix)
    assert _storage.locate(tmp_path).directory == tmp_path and _storage.locate("s3://b/r").directory is None
    location, name = _storage.locate_file("s3://bucket/run/model.safetensors")
    assert (str(location), name, location.member(name)) == (
        "s3://bucket/run",
        "model.safetensors",
        f"s3://bucket/run/{name}",
    )
    location, name = _storage.locate_file(tmp_path / "w.safetensors")
    assert (location.directory, name) == (tmp_path, "w.safetensors")


@KINDS
@given(files=FILES, record=NAMES, data=st.binary(max_size=200))
def test_a_commit_makes_the_staged_files_and_then_the_record_visible(tmp_path_factory, kind, files, record, data):
    location = _fresh(kind, tmp_path_factory.mktemp("s"))
    assert location.names() == set()
    location.prepare()
    staged: _storage.Staged = []
    for name, content in files.items():
        if location.directory is None:  # an object store takes each object whole, under its fresh name
            location.upload(name, lambda f, content=content: f.write(content))
        else:  # a filesystem stages it under a temporary name
            with atomic_file(location.directory / name, staged=staged) as fd:
                os.write(fd, content)
            assert name not in location.names()
    location.commit(staged, record, data)
    assert location.names() == {*files, record}
    assert location.read_bytes(record, "record", 1 << 20, HeaderError) == data
    for name, content in files.items():
        if name != record:
            reader = location.open_reader(name)
            assert reader.size == len(content) and reader.read(0, len(content)) == content
            assert reader.read(len(content) // 2, len(content) - len(content) // 2) == content[len(content) // 2 :]


@KINDS
@given(old=st.binary(max_size=100), new=st.binary(min_size=1, max_size=100))
def test_a_failed_upload_leaves_the_previous_record_and_nothing_else(tmp_path_factory, kind, old, new):
    location = _fresh(kind, tmp_path_factory.mktemp("s"))
    location.prepare()
    location.replace("record.json", old)

    def half_then_fail(f):
        f.write(new[: len(new) // 2])
        raise OSError(28, "No space left on device")

    with pytest.raises((SaveError, OSError)):
        location.upload("record.json", half_then_fail)
    assert location.names() == {"record.json"}
    assert location.read_bytes("record.json", "record", 1 << 20, HeaderError) == old


@KINDS
def test_a_record_over_its_cap_is_refused_naming_it(tmp_path, kind):
    location = _fresh(kind, tmp_path)
    location.prepare()
    location.replace("index.json", b"x" * 11)
    message = f"{location.member('index.json')}: index of 11 bytes exceeds the cap of 10 bytes"
    with pytest.raises(HeaderError, match=re.escape(message)):
        location.read_bytes("index.json", "index", 10, HeaderError)


@KINDS
def test_remove_is_quiet_about_what_is_gone(tmp_path, kind):
    location = _fresh(kind, tmp_path)
    location.prepare()
    location.replace("a", b"1")
    location.replace("b", b"2")
    location.remove("a")
    location.remove("a")  # gone already: nothing to do, nothing raised
    assert location.names() == {"b"}
    location.discard([])


@KINDS
def test_a_filesystem_lock_refuses_a_second_writer_and_a_bucket_has_none(tmp_path, kind):
    location = _fresh(kind, tmp_path)
    location.prepare()
    held = location.hold("a store")
    try:
        if location.directory is not None:
            with pytest.raises(DirectoryLockedError, match=re.escape("a store in process")):
                location.hold("another store")
            with pytest.raises(DirectoryLockedError), location.one_writer("a save"):
                pass
        else:  # no flock on an object store: the hold is a no-op, as its docstring says
            location.hold("another store").release()
            with location.one_writer("a save"):
                pass
    finally:
        held.release()
    with location.one_writer("a save"):  # released: the next writer gets it
        pass


def test_links_and_dead_processes_temporaries_are_seen_on_a_filesystem(tmp_path):
    location = _storage.locate(tmp_path)
    (tmp_path / "7").mkdir()
    os.symlink("elsewhere", tmp_path / "8")
    assert (location.link_target("7"), location.link_target("8")) == (None, "elsewhere")
    dead = tmp_path / f".model.safetensors{TMP_MARKER}{host_name()}-999999999-00000000"
    other = tmp_path / f".notes.txt{TMP_MARKER}{host_name()}-999999999-00000000"
    dead.write_bytes(b"")
    other.write_bytes(b"")
    location.sweep(lambda name: name == "model.safetensors")
    assert not dead.exists() and other.exists()


def test_an_http_prefix_is_read_only_and_unlisted():
    location = _storage.locate("https://example.invalid/ck")
    assert location.names() == set() and location.link_target("x") is None
    refusal = "https://example.invalid/ck/w.safetensors: an HTTP URL cannot be written to"
    for write in (lambda: location.prepare("w.safetensors"), lambda: location.replace("w.safetensors", b"")):
        with pytest.raises(SaveError, match=re.escape(refusal)):
            write()
    with pytest.raises(SaveError, match=re.escape("https://example.invalid/ck: an HTTP URL cannot be written to")):
        location.prepare()


def test_a_bucket_holds_no_staged_file(tmp_path):
    location = _fresh("object", tmp_path)
    with pytest.raises(SaveError, match=re.escape("a URL holds no staged files (1 given)")):
        location.commit([(tmp_path / "a", tmp_path / "b")], "record", b"")


def test_only_the_storage_layer_and_two_readers_tell_a_path_from_a_url():
    """Outside io/ (the storage layer and its transports), two readers ask whether a name
    is a URL: the registry's read (a URL is told by the response, a local path by its
    content) and safe_open's message for a missing local file. No writer asks: the
    layouts, save/, the bridges' saves and the store take a Location. An inline
    ``"://"`` test counts as asking."""
    import ast

    import nnx_save

    root = Path(nnx_save.__file__).parent
    asked = set()
    for file in sorted(root.rglob("*.py")):
        name = file.relative_to(root).as_posix()
        if name.startswith("io/"):
            continue
        for function in ast.walk(ast.parse(file.read_text())):
            if not isinstance(function, ast.FunctionDef):
                continue
            for node in ast.walk(function):
                called = isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None))
                if called == "is_url" or (isinstance(node, ast.Constant) and node.value == "://"):
                    asked.add(f"{name}:{function.name}")
    assert asked == {"layouts/_registry.py:_read", "bridges/_lazy.py:_read_header"}
