"""``share_reads=None`` (the default) decides on every process alike: two JAX
processes on one host share the replicated tensors of a URL (read once, the rest
received from the peer), and read a local file each for itself; ``False`` is
honoured over HTTP."""

from __future__ import annotations

import shutil

import pytest
from mp_harness import launch
from nginx_server import start_nginx

import nnx_save

pytestmark = pytest.mark.multiprocess


@pytest.fixture(scope="module")
def nginx(tmp_path_factory):
    yield from start_nginx(tmp_path_factory)


def test_the_default_shares_reads_of_a_url_and_not_of_a_local_file(files, nginx, tmp_path):
    shutil.copy(files["single"], nginx.root / "mixed.safetensors")
    url = f"{nginx.url}/mixed.safetensors"
    jobs = [
        {"path": url, "suite": "mixed", "mesh": [2, 4], "ratio": 4.0, "host": True},
        {"path": files["single"], "suite": "mixed", "mesh": [2, 4], "ratio": 4.0, "host": True},
        {"path": url, "suite": "mixed", "mesh": [2, 4], "ratio": 4.0, "host": True, "share": False},
    ]
    workers = launch("load_url.py", 2, 4, tmp_path, {"jobs": jobs})
    header = nnx_save.read_header(files["single"])
    replicated = header.tensors["norm"].nbytes  # () on the (a, b) mesh: every device holds it
    for w in workers:
        shared, local, forced_off = w.result["jobs"]
        assert all(j["checked"] > 0 and j["clean"] for j in (shared, local, forced_off))
        assert shared["bytes_received"] >= replicated // 2, shared  # half of it came from the peer
        # what it no longer reads came from its peer (bytes_read: the small file is read through either way)
        assert shared["bytes_needed"] + shared["bytes_received"] == local["bytes_needed"], (shared, local)
        assert local["bytes_received"] == forced_off["bytes_received"] == 0
        assert local["bytes_read"] == forced_off["bytes_read"], (local, forced_off)
