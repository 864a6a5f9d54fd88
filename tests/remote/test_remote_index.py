"""One index validator for local and remote checkpoints:
every case runs against a directory on disk and the same directory served by nginx,
and must give the same typed error (``HeaderError``, ``check="index"``) naming the index."""

from __future__ import annotations

import json
import re
import threading
import time
import uuid
from pathlib import Path

import numpy as np
import pytest
from _errors import raises_check
from hostile_server import Answer, HostileServer, Request

import nnx_save

INDEX = "model.safetensors.index.json"
MAX_INDEX_BYTES = 64 << 20  # the documented cap on an index (docs/reliability.md)


class Source:
    """A checkpoint directory under nginx's root, loaded locally or over HTTP."""

    def __init__(self, nginx, how: str) -> None:
        self.how, self.name = how, uuid.uuid4().hex
        self.directory = nginx.root / self.name / "model"
        self.directory.mkdir(parents=True)
        self.url = f"{nginx.url}/{self.name}/model"
        self.nginx_root = nginx.root / self.name

    @property
    def index(self) -> str:
        return str(self.directory / INDEX) if self.how == "local" else f"{self.url}/{INDEX}"

    @property
    def base(self) -> str:
        return str(self.directory) if self.how == "local" else f"{self.url}/"

    def load(self):
        return nnx_save.load_file(self.directory if self.how == "local" else f"{self.url}/{INDEX}")

    def write_index(self, body: str | bytes | dict) -> None:
        raw = json.dumps(body) if isinstance(body, dict) else body
        (self.directory / INDEX).write_bytes(raw.encode() if isinstance(raw, str) else raw)


@pytest.fixture(params=["local", "http"])
def source(request, nginx) -> Source:
    src = Source(nginx, request.param)
    nnx_save.save_file({"kernel": np.ones((2, 3), np.float32)}, src.directory / "a.safetensors")
    nnx_save.save_file(
        {"bias": np.ones(3, np.float32), "extra": np.zeros(1, np.float32)}, src.directory / "b.safetensors"
    )
    (src.nginx_root / "private").mkdir()
    nnx_save.save_file({"bias": np.full(3, 666, np.float32)}, src.nginx_root / "private" / "secret.safetensors")
    return src


def refused(src: Source, message: str) -> None:
    with raises_check("index", match=re.escape(f"{src.index}: {message}")):
        src.load()


@pytest.mark.parametrize(
    ("name", "bad"),
    [
        ("%2e%2e/private/secret.safetensors", "'%'"),
        ("..%2Fprivate%2Fsecret.safetensors", "'%'"),
        ("..\\private\\secret.safetensors", "'\\\\'"),
        ("b.safetensors?x=1", "'?'"),
        ("b.safetensors#frag", "'#'"),
        ("http://127.0.0.1:1/private/secret.safetensors", "':'"),
    ],
)
def test_encoded_and_url_shaped_file_names_are_refused(source, name, bad):
    """``%2e%2e/...`` passes a literal-``..`` check and nginx would serve the file outside
    the model's directory: refused, locally and remotely, before any request."""
    source.write_index({"weight_map": {"kernel": "a.safetensors", "bias": name}})
    refused(source, f"file name {name!r} contains {bad}; weight-map entries must be plain relative paths")


@pytest.mark.parametrize("name", ["../private/secret.safetensors", "/etc/passwd", "sub/../../x"])
def test_names_outside_the_directory_are_refused_by_both(source, name):
    source.write_index({"weight_map": {"kernel": "a.safetensors", "bias": name}})
    refused(source, f"file {name!r} points outside the checkpoint directory {source.base}")


def test_a_missing_file_is_an_index_error_for_both(source):
    source.write_index({"weight_map": {"kernel": "a.safetensors", "bias": "gone.safetensors"}})
    where = source.directory if source.how == "local" else f"{source.url}/gone.safetensors"
    message = "does not exist in" if source.how == "local" else "does not exist at"
    refused(source, f"names file 'gone.safetensors', which {message} {where}")


def test_duplicate_tensor_keys_are_refused_by_both(source):
    """Two ``weight_map`` entries for one tensor are refused, not resolved to the last."""
    source.write_index(
        '{"weight_map": {"kernel": "a.safetensors", "bias": "b.safetensors", "extra": "b.safetensors",'
        ' "bias": "a.safetensors"}}'
    )
    refused(source, "key 'bias' appears more than once in the index JSON")


def test_duplicate_metadata_keys_are_refused_by_both(source):
    source.write_index(
        '{"metadata": {"total_size": 1, "total_size": 2}, "weight_map": {"kernel": "a.safetensors",'
        ' "bias": "b.safetensors", "extra": "b.safetensors"}}'
    )
    refused(source, "key 'total_size' appears more than once in the index JSON")


def test_deep_nesting_is_a_typed_error_not_a_recursion_error(source):
    """A deeply nested index is a typed error remotely too, not a raw ``RecursionError``."""
    source.write_index('{"metadata": ' + "[" * 100_000 + "]" * 100_000 + ', "weight_map": {}}')
    refused(source, "not a valid JSON index: nested too deeply")


def test_files_holding_tensors_the_index_does_not_name_are_refused_by_both(source):
    """A file holding a tensor the index omits is refused remotely as locally."""
    source.write_index({"weight_map": {"kernel": "a.safetensors", "bias": "b.safetensors"}})
    refused(source, "files hold tensors the index does not name: ['extra']")


def test_a_large_real_sized_index_loads_by_both(source):
    """A valid 89 KB index (1,100 tensors) loads remotely: no size cap calls it "larger
    than any real index"; DeepSeek-scale indexes are megabytes."""
    names = [f"model.layers.{i}.self_attn.q_proj.weight_with_a_long_descriptive_suffix" for i in range(1100)]
    half = len(names) // 2
    for file, part in (("a.safetensors", names[:half]), ("b.safetensors", names[half:])):
        nnx_save.save_file({n: np.full(2, i, np.float32) for i, n in enumerate(part)}, source.directory / file)
    weight_map = {n: "a.safetensors" if i < half else "b.safetensors" for i, n in enumerate(names)}
    source.write_index({"metadata": {"total_size": 8 * len(names)}, "weight_map": weight_map})
    assert (source.directory / INDEX).stat().st_size > 88_000
    out = source.load()
    assert sorted(out) == sorted(names)
    assert all(float(out[n][0]) == (i if i < half else i - half) for i, n in enumerate(names))


def test_an_index_over_the_cap_is_refused_by_both(source):
    """The cap real indexes fit under (64 MiB), checked before the body is read."""
    with open(source.directory / INDEX, "wb") as f:
        f.write(b'{"weight_map": {}}')
        f.truncate(MAX_INDEX_BYTES + 1)
    size = MAX_INDEX_BYTES + 1
    refused(source, f"index of {size} bytes exceeds the cap of {MAX_INDEX_BYTES} bytes")


def test_the_directory_url_finds_its_index(nginx):
    src = Source(nginx, "http")
    nnx_save.save_file({"w": np.arange(3, dtype=np.float32)}, src.directory / "a.safetensors")
    src.write_index({"weight_map": {"w": "a.safetensors"}})
    assert np.array_equal(nnx_save.load_file(src.url)["w"], np.arange(3, dtype=np.float32))
    assert Path(src.directory / INDEX).is_file()


def test_the_member_headers_are_probed_at_once(tmp_path):
    """Each member's header costs a round trip: they are asked together, not one after another."""
    files = 4
    tree = {f"w{i}": np.full(5, i, np.float32) for i in range(files)}
    nnx_save.save_file(tree, tmp_path, max_shard_size=20)
    objects = {f"/ckpt/{p.name}": p.read_bytes() for p in tmp_path.iterdir()}
    assert len(objects) == files + 1, sorted(objects)
    lock, active, peak = threading.Lock(), [0], [0]

    def slow_members(request: Request, answer: Answer) -> Answer:
        if request.path.endswith(".safetensors") and request.headers.get("Range", "").startswith("bytes=0-"):
            with lock:  # a header's probe (data ranges begin after the header)
                active[0] += 1
                peak[0] = max(peak[0], active[0])
            time.sleep(0.3)  # a slow link's round trip
            with lock:
                active[0] -= 1
        return answer

    with HostileServer(objects, slow_members) as server:
        loaded = nnx_save.load_file(f"{server.url}/ckpt/{INDEX}")
    assert sorted(loaded) == sorted(tree)
    for key, value in tree.items():
        assert np.array_equal(loaded[key], value), key
    assert peak[0] >= 2, f"member headers were probed one at a time (peak {peak[0]} in flight)"
