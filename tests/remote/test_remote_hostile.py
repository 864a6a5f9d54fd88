"""Lying HTTP servers and changing fsspec objects: each answer is either the exact data or a typed error naming the
URL, never the bytes of another version, never an unbounded read, never a hang.

The server is tests/remote/hostile_server.py on 127.0.0.1; each test states the
lie it pins.
"""

from __future__ import annotations

import dataclasses
import gzip
import re
import time
import tracemalloc
import uuid

import numpy as np
import pytest
from hostile_server import Answer, HostileServer, Request

import nnx_save
from nnx_save.errors import RemoteError

V1 = {"w": np.arange(64, dtype=np.float32), "b": np.full(16, 3.0, np.float32)}
V2 = {"w": -np.arange(64, dtype=np.float32), "b": np.full(16, 7.0, np.float32)}  # same size, other bytes


def blob(tmp_path, tree) -> bytes:
    path = tmp_path / f"{uuid.uuid4().hex}.safetensors"
    nnx_save.save_file(tree, path)
    return path.read_bytes()


def exact(out, tree) -> bool:
    return sorted(out) == sorted(tree) and all(np.array_equal(np.asarray(out[k]), v) for k, v in tree.items())


def data_request(req: Request) -> bool:
    return req.number > 1  # request 1 is the header probe


def test_a_vanished_etag_is_a_change(tmp_path):
    """The server drops the ETag while replacing same-size content."""
    one, two = blob(tmp_path, V1), blob(tmp_path, V2)
    assert len(one) == len(two)
    with HostileServer({"/m.safetensors": one}) as server:
        server.etags["/m.safetensors"] = '"v1"'
        url = f"{server.url}/m.safetensors"
        header = nnx_save.read_header(url)
        server.objects["/m.safetensors"] = two
        del server.etags["/m.safetensors"]
        with pytest.raises(
            nnx_save.SourceChangedError,
            match=re.escape(f'{url}: the object changed during the load (size {len(one)} -> {len(two)}, version "v1"'),
        ):
            nnx_save.load_file(header)


def test_a_pinned_etag_is_sent_with_if_match_and_412_is_a_change(tmp_path):
    """The If-Match half: later ranges ask for the pinned version; a server
    that no longer has it answers 412, which is a change."""
    one, two = blob(tmp_path, V1), blob(tmp_path, V2)

    def lie(req: Request, answer: Answer) -> Answer:
        tag = server.etags["/m.safetensors"]
        if req.headers.get("If-Match") not in (None, tag):
            return Answer(412, {"Content-Length": "0"}, b"")
        return answer

    with HostileServer({"/m.safetensors": one}, lie) as server:
        server.etags["/m.safetensors"] = '"v1"'
        url = f"{server.url}/m.safetensors"
        header = nnx_save.read_header(url)
        assert exact(nnx_save.load_file(header), V1)
        assert all(r.headers.get("If-Match") == '"v1"' for r in server.requests[1:])
        server.objects["/m.safetensors"], server.etags["/m.safetensors"] = two, '"v2"'
        with pytest.raises(nnx_save.SourceChangedError, match=re.escape(f"{url}: the object changed during the load")):
            nnx_save.load_file(header)


def encoded(req: Request, answer: Answer) -> Answer:
    """gzip named, identity bytes sent: the body alone cannot tell."""
    if data_request(req):
        answer.headers["Content-Encoding"] = "gzip"
    return answer


def gzipped(req: Request, answer: Answer) -> Answer:
    if data_request(req):
        answer.body = gzip.compress(answer.body)
        answer.headers.update({"Content-Encoding": "gzip", "Content-Length": str(len(answer.body))})
    return answer


def longer_chunked(req: Request, answer: Answer) -> Answer:
    if data_request(req):
        return dataclasses.replace(answer, body=answer.body + b"EXTRA", chunked=True)
    return answer


def longer_declared(req: Request, answer: Answer) -> Answer:
    if data_request(req):
        answer.body += b"EXTRA"
        answer.headers["Content-Length"] = str(len(answer.body))
    return answer


@pytest.mark.parametrize(
    ("lie", "message"),
    [
        (encoded, "came with Content-Encoding 'gzip'; ranges are asked with Accept-Encoding: identity"),
        (gzipped, "came with Content-Encoding 'gzip'"),
        (longer_chunked, "is longer than the range"),
        (longer_declared, "came with Content-Length"),
    ],
    ids=["gzip-named", "gzip-sent", "chunked-longer", "content-length-longer"],
)
def test_a_data_range_must_be_unencoded_and_exactly_its_length(tmp_path, lie, message):
    """An encoded ranged response is never copied raw into the tensor, and a body
    longer than the range is refused, not cut silently."""
    with HostileServer({"/m.safetensors": blob(tmp_path, V1)}, lie) as server:
        url = f"{server.url}/m.safetensors"
        with pytest.raises(RemoteError, match=re.escape(url) + ".*" + re.escape(message)):
            nnx_save.load_file(url, num_threads=1)
        assert all(r.headers.get("Accept-Encoding") == "identity" for r in server.requests)


def test_the_header_probe_reads_at_most_what_it_asked(tmp_path):
    """After asking for 64 KiB the probe reads no more than that, not whatever the server
    sends (a chunked body of hundreds of MiB): it stops at the range and refuses the rest."""
    data = blob(tmp_path, V1)
    body = data + bytes(64 << 20)  # built before tracing: only the client's memory counts

    def lie(req: Request, answer: Answer) -> Answer:
        return dataclasses.replace(answer, body=body, chunked=True) if req.number == 1 else answer

    with HostileServer({"/m.safetensors": data}, lie) as server:
        url = f"{server.url}/m.safetensors"
        tracemalloc.start()
        try:
            with pytest.raises(RemoteError, match=re.escape(f"{url}: the body for bytes 0-") + ".* is longer than"):
                nnx_save.read_header(url)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
    assert peak < 8 << 20, peak  # the server's 1 MiB chunks included; reading it all would be 64 MiB


def test_a_trickling_server_hits_the_deadline(tmp_path, monkeypatch):
    """One byte every few seconds never trips a socket timeout; each request has a
    deadline (NNX_SAVE_HTTP_TIMEOUT plus its length at NNX_SAVE_HTTP_MIN_RATE)."""
    monkeypatch.setenv("NNX_SAVE_HTTP_TIMEOUT", "1")
    monkeypatch.setenv("NNX_SAVE_HTTP_MIN_RATE", "1000000")

    def lie(req: Request, answer: Answer) -> Answer:
        return dataclasses.replace(answer, trickle_s=0.05) if data_request(req) else answer

    with HostileServer({"/m.safetensors": blob(tmp_path, V1)}, lie) as server:
        url = f"{server.url}/m.safetensors"
        t0 = time.monotonic()
        with pytest.raises(RemoteError, match=re.escape(url) + r": bytes \d+-\d+ not received within 1\.0 s"):
            nnx_save.load_file(url, num_threads=1)  # 320 bytes at 20 bytes/s would take 16 s
        assert time.monotonic() - t0 < 6


_STALLS = {
    "mid-body": lambda answer: dataclasses.replace(answer, stall_after=len(answer.body) // 2, stall_s=30.0),
    "before the body": lambda answer: dataclasses.replace(answer, stall_after=0, stall_s=30.0),
    "before the headers": lambda answer: dataclasses.replace(answer, delay_s=30.0),
    "slow 503s": lambda answer: Answer(503, {"Content-Length": "0"}, b"", delay_s=0.6),
    "cut bodies": lambda answer: dataclasses.replace(
        answer, body=answer.body[: len(answer.body) // 2], headers={**answer.headers, "Connection": "close"}
    ),
}


@pytest.mark.parametrize("how", sorted(_STALLS))
def test_one_deadline_bounds_a_range_with_every_retry(tmp_path, monkeypatch, how):
    """A server that stalls (mid-body, before the body or the headers), answers 503 slowly,
    or cuts every body short: the range fails within its one deadline (timeout plus its
    length at the rate), retries included, not within a deadline per attempt (six of them)."""
    monkeypatch.setenv("NNX_SAVE_HTTP_TIMEOUT", "1")
    monkeypatch.setenv("NNX_SAVE_HTTP_MIN_RATE", "1000000")

    def lie(req: Request, answer: Answer) -> Answer:
        return _STALLS[how](answer) if data_request(req) else answer

    with HostileServer({"/m.safetensors": blob(tmp_path, V1)}, lie) as server:
        url = f"{server.url}/m.safetensors"
        header = nnx_save.read_header(url)
        t0 = time.monotonic()
        with pytest.raises(
            RemoteError, match=re.escape(url) + r": bytes \d+-\d+ (not received within 1\.0 s|failed after)"
        ):
            nnx_save.load_file(header, num_threads=1)
        elapsed = time.monotonic() - t0
    assert elapsed < 1.0 + 0.75, elapsed  # one deadline (1.0 s) and the time to raise


def test_the_deadline_settings_are_checked(monkeypatch):
    monkeypatch.setenv("NNX_SAVE_HTTP_TIMEOUT", "0")
    with pytest.raises(
        nnx_save.errors.ConfigError, match=re.escape("NNX_SAVE_HTTP_TIMEOUT='0': expected a positive number")
    ):
        nnx_save.read_header("http://127.0.0.1:9/m.safetensors")


def redirecting(routes: dict[str, str]):
    def lie(req: Request, answer: Answer) -> Answer:
        if req.path in routes:
            return Answer(302, {"Location": routes[req.path], "Content-Length": "0"}, b"")
        return answer

    return lie


def test_redirects_are_followed_and_pinned_at_the_final_url(tmp_path):
    """Hub ``resolve/`` URLs redirect to a CDN: the redirect is followed, not refused as
    "must answer ranges with 206". A redirect that later leads to another version is a change."""
    one, two = blob(tmp_path, V1), blob(tmp_path, V2)
    routes = {"/resolve/m.safetensors": "/cdn/v1.safetensors"}
    with HostileServer({"/cdn/v1.safetensors": one, "/cdn/v2.safetensors": two}, redirecting(routes)) as server:
        server.etags.update({"/cdn/v1.safetensors": '"v1"', "/cdn/v2.safetensors": '"v2"'})
        url = f"{server.url}/resolve/m.safetensors"
        header = nnx_save.read_header(url)
        assert exact(nnx_save.load_file(header), V1)
        routes["/resolve/m.safetensors"] = f"{server.url}/cdn/v2.safetensors"  # an absolute Location
        with pytest.raises(nnx_save.SourceChangedError, match=re.escape(f"{url}: the object changed during the load")):
            nnx_save.load_file(header)


@pytest.mark.parametrize(
    ("location", "message"),
    [
        ("/loop.safetensors", "more than 5 redirects"),
        ("file:///etc/passwd", "redirected to 'file:///etc/passwd', not http(s)"),
    ],
)
def test_redirect_loops_and_foreign_schemes_are_refused(tmp_path, location, message):
    with HostileServer({}, redirecting({"/loop.safetensors": location})) as server:
        url = f"{server.url}/loop.safetensors"
        with pytest.raises(RemoteError, match=re.escape(url) + ".*" + re.escape(message)):
            nnx_save.read_header(url)


def test_a_redirect_chain_and_503s_are_followed_retried_and_counted(tmp_path):
    """Three hops (relative, absolute, relative) to the object, whose every range is first
    answered 503: the load is exact, each range asked with its Range header at every hop,
    each 503 one retry in the report. The redirect and 503 bodies trickle (12 s each if
    read): they are closed, never drained."""
    one = blob(tmp_path, V1)
    slow = {"Content-Length": "240"}
    refused: set[str] = set()

    def lie(req: Request, answer: Answer) -> Answer:
        hops = {"/a.safetensors": "/b.safetensors", "/b.safetensors": f"{server.url}/c.safetensors"}
        hops["/c.safetensors"] = "/cdn/m.safetensors"
        if req.path in hops:
            return Answer(302, {**slow, "Location": hops[req.path]}, b"x" * 240, trickle_s=0.05)
        if req.headers["Range"] not in refused:
            refused.add(req.headers["Range"])
            return Answer(503, slow, b"x" * 240, trickle_s=0.05)
        return answer

    with HostileServer({"/cdn/m.safetensors": one}, lie) as server:
        server.etags["/cdn/m.safetensors"] = '"v1"'
        t0 = time.monotonic()
        out, report = nnx_save.load_file(f"{server.url}/a.safetensors", num_threads=1, return_report=True)
        assert time.monotonic() - t0 < 10
        assert exact(out, V1)
        assert report.io.retries == len(refused) >= 2  # the header probe and the data
        assert all("Range" in r.headers for r in server.requests)
        hops = ["/a.safetensors", "/b.safetensors", "/c.safetensors", "/cdn/m.safetensors", "/cdn/m.safetensors"]
        assert [r.path for r in server.requests[:5]] == hops  # refused, then asked again at the final URL


@pytest.fixture
def memory_url():
    fsspec = pytest.importorskip("fsspec")
    fs = fsspec.filesystem("memory")
    path = f"/nnx_save-{uuid.uuid4().hex}/m.safetensors"
    yield fs, f"memory://{path}"
    fs.rm(path)


def test_an_fsspec_object_replaced_after_its_header_was_read_is_a_change(tmp_path, memory_url):
    """Replace a ``memory://`` (or ``s3://``, ``gs://`` ...) object between ``read_header``
    and ``load_file(header)``: the load must not return the new bytes under the old
    header, so it is pinned to the size and the version fields of ``info()``."""
    fs, url = memory_url
    one, two = blob(tmp_path, V1), blob(tmp_path, V2)
    fs.pipe(url, one)
    header = nnx_save.read_header(url)
    assert exact(nnx_save.load_file(header), V1)
    time.sleep(0.01)  # memory:// versions by creation time (microseconds)
    fs.pipe(url, two)
    with pytest.raises(
        nnx_save.SourceChangedError, match=re.escape(f"{url}: the object changed during the load (size ")
    ):
        nnx_save.load_file(header)
    assert exact(nnx_save.load_file(url), V2)  # a fresh load reads the new version


def test_an_fsspec_store_error_is_a_remote_error_naming_the_url(memory_url, monkeypatch):
    """Each store raises its own errors (botocore's NoCredentialsError for ``s3://``
    without credentials); they reach the caller as a RemoteError naming the URL."""
    fs, url = memory_url
    fs.pipe(url, b"x" * 16)

    def no_credentials(*args, **kwargs):
        raise RuntimeError("Unable to locate credentials")

    monkeypatch.setattr(type(fs), "info", no_credentials)
    with pytest.raises(
        RemoteError,
        match=re.escape(f"{url}: fsspec could not describe the object (RuntimeError: Unable to locate credentials)"),
    ):
        nnx_save.read_header(url)


def test_an_fsspec_object_replaced_during_the_load_is_a_change(tmp_path, memory_url, monkeypatch):
    """Mid-load: the object is replaced after the first data read; the
    reader's check when it closes sees the new version."""
    fs, url = memory_url
    one, two = blob(tmp_path, V1), blob(tmp_path, V2)
    fs.pipe(url, one)
    header = nnx_save.read_header(url)
    real = type(fs).cat_file

    def cat_then_replace(self, path, start=None, end=None, **kwargs):
        data = real(self, path, start=start, end=end, **kwargs)
        time.sleep(0.01)
        fs.pipe(url, two)  # same size, other bytes, a new creation time
        return data

    monkeypatch.setattr(type(fs), "cat_file", cat_then_replace)
    with pytest.raises(
        nnx_save.SourceChangedError, match=re.escape(f"{url}: the object changed during the load (size ")
    ):
        nnx_save.load_file(header, num_threads=1)


def test_no_validator_never_mixes_two_versions(tmp_path):
    """A server with no ETag and no Last-Modified swaps a same-size
    version between two reads of one handle: the second read is checked against the
    checksum the header recorded and refused, never v2's bytes under v1's header."""
    one, two = blob(tmp_path, V1), blob(tmp_path, V2)
    assert len(one) == len(two)
    with HostileServer({"/m.safetensors": one}) as server:
        url = f"{server.url}/m.safetensors"
        with nnx_save.safe_open(url) as f:
            assert np.array_equal(f.get_tensor("w"), V1["w"])
            server.objects["/m.safetensors"] = two
            with pytest.raises(nnx_save.errors.ChecksumError, match=re.escape(f"{url}: tensor 'b': checksum mismatch")):
                f.get_tensor("b")
        server.objects["/m.safetensors"] = one
        assert exact(nnx_save.load_file(url), V1)  # unchanged: whole tensors load, verified


def test_no_validator_and_nothing_to_check_is_refused(tmp_path):
    """Where neither a validator nor a recorded checksum pins the bytes (a slice; a file
    of another tool), the read is refused with a RemoteError saying why."""
    import safetensors.numpy

    foreign = tmp_path / "f.safetensors"
    safetensors.numpy.save_file(V1, str(foreign))
    with HostileServer({"/f.safetensors": foreign.read_bytes(), "/m.safetensors": blob(tmp_path, V1)}) as server:
        why = "the server sends neither an ETag nor a Last-Modified header, so the object's version cannot be pinned"
        with pytest.raises(RemoteError, match=re.escape(f"{server.url}/f.safetensors: {why}")):
            nnx_save.load_file(f"{server.url}/f.safetensors")
        with nnx_save.safe_open(f"{server.url}/m.safetensors") as f, pytest.raises(RemoteError, match=re.escape(why)):
            f.get_slice("w")[2:5]
        server.etags["/f.safetensors"] = '"v1"'  # a validator pins it: no checksum needed
        assert exact(nnx_save.load_file(f"{server.url}/f.safetensors"), V1)
