"""Two JAX processes load one URL with a dim-0 sharding: nginx's access log shows
each process requesting only the byte ranges of its own shards."""

from __future__ import annotations

import re
import shutil

import pytest
from mp_harness import launch
from nginx_server import start_nginx

import nnx_save

pytestmark = pytest.mark.multiprocess


@pytest.fixture(scope="module")
def nginx(tmp_path_factory):
    yield from start_nginx(tmp_path_factory)


def test_each_process_requests_only_its_own_ranges(files, nginx, tmp_path):
    shutil.copy(files["rows"], nginx.root / "rows.safetensors")
    url = f"{nginx.url}/rows.safetensors"
    header = nnx_save.read_header(url)
    nginx.clear_log()
    workers = launch("load_url.py", 2, 4, tmp_path, {"jobs": [{"path": url, "suite": "rows", "mesh": [2, 4]}]})
    log = [r for r in nginx.requests() if r.uri == "/rows.safetensors"]
    assert log and all(r.status == 206 for r in log)
    data = sum(t.nbytes for t in header.tensors.values())
    ranges = {}
    for w in workers:
        job = w.result["jobs"][0]
        assert job["bytes_read"] == job["bytes_needed"] == data // 2 and job["checked"] == 4 * 4
        mine = [r for r in log if f"(pid {w.result['pid']})" in r.agent]
        spans = [tuple(map(int, re.fullmatch(r"bytes=(\d+)-(\d+)", r.range).groups())) for r in mine]
        data_spans = [(a, b + 1) for a, b in spans if a >= header.files[0].data_start]
        # two loads per worker (one warm-up): each time exactly its half of every tensor
        assert sum(b - a for a, b in data_spans) == 2 * data // 2
        for a, b in data_spans:  # process i owns rows [i*256, (i+1)*256) of every 512-row tensor
            t = next(t for t in header.tensors.values() if t.begin <= a < t.end)
            half = t.nbytes // 2
            owner = (a - t.begin) // half
            assert owner == w.process_id and b <= t.begin + (owner + 1) * half, (w.process_id, t.name, a, b)
        ranges[w.process_id] = set(data_spans)
    assert not ranges[0] & ranges[1]
    assert len(log) == sum(1 for r in log if "(pid " in r.agent)  # every request is from a worker
