"""Fuzzing the index and pod-manifest parsers and HTTP responses.

Same contract as tests/reliability/test_reliability_fuzz.py, with "exact data" checked: every
input either raises a library error (an :class:`~nnx_save.NnxSaveError`;
``FileNotFoundError`` for a missing file) or loads, and a load must return exactly
the tensors that were saved (the shard files and served bytes are real; only the
index, the manifest or the HTTP answers are mutated). Never another exception,
never a hang (a per-input alarm). Seeded and bounded in count and time.

- ``test_fuzz_index``: mutated ``model.safetensors.index.json`` over two real files,
  read locally and, one input in four, over HTTP from a server on 127.0.0.1.
- ``test_fuzz_pod_manifest``: mutated ``manifest.json`` of a pod directory whose
  tensors are split into pieces (boxes that overlap, leave holes, change shape...).
- ``test_fuzz_http_responses``: a server answering each request honestly or with a
  mutated status, Content-Range, Content-Length, ETag, Content-Encoding, chunking or
  body (data ranges only: a changed header body can describe other valid tensors,
  which no check can tell), loaded with ``verify=True``.
"""

from __future__ import annotations

import copy
import dataclasses
import gzip
import json
import random
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

import nnx_save

sys.path.insert(0, str(Path(__file__).parents[1] / "remote"))
from hostile_server import Answer, HostileServer, Request

SEED = 1830
PER_INPUT_LIMIT_S = 10.0  # far above any real input; only a hang reaches it
INDEX = "model.safetensors.index.json"
HOSTILE_NAMES = [
    "../a.safetensors", "/etc/passwd", "%2e%2e/a.safetensors", "a.safetensors%00", "a\\b", "a?b", "a#b", "",
    ".", "./a.safetensors", "sub//a.safetensors", "http://127.0.0.1:1/a", "a.safetensors\x00", "é.safetensors",
    "b.safetensors", "a.safetensors", "missing.safetensors", "a.safetensors/..", "...",
]  # fmt: skip
INTERESTING = [0, 1, -1, 2, 3, 8, 2**31, 2**63, 10**30, 1.5, "", "x", None, True, [], {}, [[0, 1]], [[0, 2], [0, 4]]]


class Hang(BaseException):
    pass


def _alarm(signum, frame):
    raise Hang()


def fuzz(
    count: int,
    budget_s: float,
    make: Callable[[random.Random], object],
    run: Callable[[object], None],
    kind: Callable[[BaseException], str] = lambda e: type(e).__name__,
) -> dict:
    """Run up to ``count`` inputs (fewer once ``budget_s`` is spent); fail on any
    outcome but a return or a library error. ``refused`` counts errors by ``kind``."""
    rng, t0 = random.Random(SEED), time.monotonic()
    stats = {"inputs": 0, "accepted": 0, "refused": {}}
    previous = signal.signal(signal.SIGALRM, _alarm)
    try:
        for i in range(count):
            if time.monotonic() - t0 > budget_s:
                break
            case = make(rng)
            signal.setitimer(signal.ITIMER_REAL, PER_INPUT_LIMIT_S)
            try:
                run(case)
                stats["accepted"] += 1
            except (nnx_save.NnxSaveError, FileNotFoundError) as e:
                stats["refused"][kind(e)] = stats["refused"].get(kind(e), 0) + 1
            except BaseException as e:
                what = "a hang" if isinstance(e, Hang) else f"{type(e).__name__}: {e}"
                raise AssertionError(f"input {i}: {what}\n{str(case)[:600]}") from e
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
            stats["inputs"] += 1
    finally:
        signal.signal(signal.SIGALRM, previous)
    stats["seconds"] = round(time.monotonic() - t0, 1)
    return stats


def mutate_json(node: object, rng: random.Random, names: list[str]) -> object:
    """One structural mutation somewhere in a JSON tree (returns a new tree)."""
    node = copy.deepcopy(node)
    path, cur = [], node
    while isinstance(cur, (dict, list)) and cur and rng.random() < 0.75:
        key = rng.choice(list(cur)) if isinstance(cur, dict) else rng.randrange(len(cur))
        path.append((cur, key))
        cur = cur[key]
    if not path:
        return rng.choice(INTERESTING)
    parent, key = path[-1]
    roll = rng.random()
    if roll < 0.35:
        parent[key] = rng.choice(INTERESTING + names)
    elif roll < 0.5 and isinstance(parent, dict):
        del parent[key]
    elif roll < 0.6 and isinstance(parent, dict):
        parent[rng.choice(names) if rng.random() < 0.5 else f"{key}_copy"] = copy.deepcopy(parent[key])
    elif roll < 0.7 and isinstance(parent, list):
        parent.append(copy.deepcopy(parent[key]))
    elif roll < 0.85 and isinstance(parent[key], int) and not isinstance(parent[key], bool):
        parent[key] += rng.choice([-2, -1, 1, 2, 2**32])
    elif isinstance(parent[key], str):
        parent[key] = rng.choice(names)
    else:
        parent[key] = [parent[key]] if rng.random() < 0.5 else {"x": parent[key]}
    return node


def encode(obj: object, rng: random.Random) -> bytes:
    """JSON text, sometimes with a repeated key, deep nesting or a byte-level change."""
    raw = json.dumps(obj).encode()
    roll = rng.random()
    if roll < 0.08 and raw.startswith(b"{") and len(raw) > 2:
        first = raw[1:].split(b",")[0].rstrip(b"}")
        raw = raw[:-1] + b"," + first + b"}"  # the first member again
    elif roll < 0.12:
        depth = rng.choice([100, 5_000, 200_000])
        raw = raw[:-1] + b', "deep": ' + b"[" * depth + b"]" * depth + b"}"
    elif roll < 0.3 and raw:
        blob, i = bytearray(raw), rng.randrange(len(raw))
        blob[i] = rng.choice(b'\x00\xff"{}[],:-0123456789 %\\')
        raw = bytes(blob)
    return raw


def check_exact(out: dict, expected: dict[str, np.ndarray], source_of: Callable[[str], str]) -> None:
    for key, value in out.items():
        want = expected[source_of(key)]
        assert np.asarray(value).dtype == want.dtype and np.array_equal(np.asarray(value), want), key


# ----------------------------------------------------------------------------------- the index

A = {"w": np.arange(12, dtype=np.float32).reshape(3, 4), "v": np.arange(5, dtype=np.int64)}
B = {"u": np.full((2, 2), 7, np.float16), "t": np.array([True, False])}


@pytest.mark.slow
def test_fuzz_index(tmp_path):
    directory = tmp_path / "ckpt"
    directory.mkdir()
    nnx_save.save_file(A, directory / "a.safetensors")
    nnx_save.save_file(B, directory / "b.safetensors")
    seed = {
        "metadata": {"total_size": 100},
        "weight_map": {**dict.fromkeys(A, "a.safetensors"), **dict.fromkeys(B, "b.safetensors")},
    }
    expected = {**A, **B}
    names = [*HOSTILE_NAMES, *expected]

    def make(rng: random.Random) -> tuple[bytes, bool]:
        obj = seed
        for _ in range(rng.randint(1, 3)):
            obj = mutate_json(obj, rng, names)
        return encode(obj, rng), rng.random() < 0.25

    with HostileServer({}) as server:

        def run(case: tuple[bytes, bool]) -> None:
            raw, remote = case
            (directory / INDEX).write_bytes(raw)
            if remote:
                server.objects = {f"/ckpt/{p.name}": p.read_bytes() for p in directory.iterdir()}
                source = f"{server.url}/ckpt/{INDEX}"
            else:
                source = directory
            header = nnx_save.read_header(source)
            check_exact(nnx_save.load_file(header, verify=True), expected, lambda k: k)

        stats = fuzz(3000, 60.0, make, run, index_check)
    print(f"\nindex: {stats}")
    # both sides reached: loads, and refusals by most of the validator's checks (one error class: HeaderError, check "index")
    assert stats["inputs"] >= 500 and stats["accepted"] >= 20 and len(stats["refused"]) >= 6, stats


INDEX_CHECKS = [
    "not a valid JSON index",
    "appears more than once",
    "expected an object with a 'weight_map'",
    "points outside the checkpoint directory",
    "weight-map entries must be plain relative paths",
    "which does not exist",
    "which does not hold it",
    "but it is in",
    "files hold tensors the index does not name",
]


def index_check(e: BaseException) -> str:
    """Which of the validator's checks refused (a HeaderError of check "index" is the only class)."""
    found = [c for c in INDEX_CHECKS if c in str(e)]
    return f"{type(e).__name__}: {found[0] if found else str(e)[-80:]}"


# ------------------------------------------------------------------------------- the manifest


@pytest.mark.slow
def test_fuzz_pod_manifest(tmp_path):
    directory = tmp_path / "pod"
    directory.mkdir()
    w, b = np.arange(32, dtype=np.float32).reshape(4, 8), np.arange(6, dtype=np.int32)
    shard = "shard_00000-of-00001.0badcafe.safetensors"
    pieces = {"w.0": w[:2, :4], "w.1": w[:2, 4:], "w.2": w[2:, :], "b.0": b}
    nnx_save.save_file(pieces, directory / shard)
    box = lambda *b: [list(x) for x in b]  # noqa: E731
    seed = {
        "format": "nnx_save.pod",
        "version": 1,
        "num_processes": 1,
        "metadata": {"made_by": "fuzz"},
        "tensors": {
            "w": {
                "dtype": "F32",
                "shape": [4, 8],
                "pieces": [
                    {"file": shard, "name": "w.0", "box": box((0, 2), (0, 4)), "process": 0},
                    {"file": shard, "name": "w.1", "box": box((0, 2), (4, 8)), "process": 0},
                    {"file": shard, "name": "w.2", "box": box((2, 4), (0, 8)), "process": 0},
                ],
            },
            "b": {
                "dtype": "I32",
                "shape": [6],
                "pieces": [{"file": shard, "name": "b.0", "box": box((0, 6)), "process": 0}],
            },
        },
    }
    names = [
        "w",
        "b",
        "w.0",
        "w.1",
        "w.2",
        "b.0",
        shard,
        "shard_00001-of-00002.0badcafe.safetensors",
        "F32",
        "I32",
        "F16",
    ]
    (directory / "manifest.json").write_text(json.dumps(seed))
    seed_out = nnx_save.load_file(directory)
    assert np.array_equal(seed_out["w"], w) and np.array_equal(seed_out["b"], b)

    def make(rng: random.Random) -> bytes:
        obj = seed
        for _ in range(rng.randint(1, 3)):
            obj = mutate_json(obj, rng, names)
        return encode(obj, rng)

    def run(raw: bytes) -> None:
        (directory / "manifest.json").write_bytes(raw)
        header = nnx_save.read_header(directory)
        out = nnx_save.load_file(header)
        for key, value in out.items():  # each tensor assembled exactly from its pieces
            assembled = np.zeros(header[key].shape, value.dtype)
            for piece in header.pieces_of(key):
                assembled[tuple(slice(lo, hi) for lo, hi in piece.box)] = pieces[piece.info.name]
            assert np.array_equal(np.asarray(value), assembled), key

    stats = fuzz(3000, 60.0, make, run, kind=lambda e: f"{type(e).__name__}({getattr(e, 'check', None)})")
    print(f"\nmanifest: {stats}")  # refusals by class and check (the manifest's checks are HeaderError's)
    assert stats["inputs"] >= 500 and stats["accepted"] >= 20 and len(stats["refused"]) >= 2, stats


# ------------------------------------------------------------------------------ HTTP responses

STATUSES = [200, 204, 206, 301, 302, 304, 400, 403, 404, 412, 416, 500, 503]
ENCODINGS = ["gzip", "br", "deflate", "identity", "IDENTITY", "", "gzip, identity"]


def lie_with(rng: random.Random) -> Callable[[Request, Answer], Answer]:
    """A seeded plan: each request is answered honestly or with one or two mutations."""
    plan = [rng.random() for _ in range(64)]
    seeds = [rng.randrange(2**32) for _ in range(64)]

    def lie(req: Request, answer: Answer) -> Answer:
        n = req.number - 1
        if n >= len(plan) or plan[n] < 0.5:
            return answer
        r = random.Random(seeds[n])
        for _ in range(r.randint(1, 2)):
            answer = mutate_answer(answer, r, data=req.number > 1)
        return answer

    return lie


def mutate_answer(a: Answer, r: random.Random, data: bool) -> Answer:
    h = dict(a.headers)
    roll = r.random()
    if roll < 0.1:
        status = r.choice(STATUSES)
        if status in (301, 302):
            h["Location"] = r.choice(["/m.safetensors", "/nowhere", "ftp://x/y", "", "//127.0.0.1:1/z"])
        return dataclasses.replace(a, status=status, headers=h)
    if roll < 0.25 and "Content-Range" in h:
        begin, rest = h["Content-Range"][6:].split("-")
        end, total = rest.split("/")
        begin, end, total = int(begin), int(end), int(total)
        h["Content-Range"] = r.choice(
            [f"bytes {begin + 1}-{end}/{total}", f"bytes {begin}-{end - 1}/{total}", f"bytes {begin}-{end}/{total + 8}",
             f"bytes {begin}-{end}/*", "bytes */0", "garbage", f"bytes {begin}-{end}"]
        )  # fmt: skip
    elif roll < 0.35:
        h["Content-Length"] = r.choice([str(len(a.body) + r.choice([-3, -1, 1, 5])), "abc", "-1", "0"])
        if r.random() < 0.5:
            return dataclasses.replace(a, headers=h, body=a.body[: max(0, len(a.body) - 3)])
    elif roll < 0.45:
        h["ETag"] = r.choice(['"other"', "", 'W/"weak"'])
        if r.random() < 0.5:
            h.pop("ETag")
    elif roll < 0.5:
        h["Last-Modified"] = "Mon, 30 Nov 2026 00:00:00 GMT"
    elif roll < 0.6:
        h["Content-Encoding"] = r.choice(ENCODINGS)
    elif roll < 0.7:
        body = gzip.compress(a.body)
        h.update({"Content-Encoding": "gzip", "Content-Length": str(len(body))})
        return dataclasses.replace(a, headers=h, body=body)
    elif roll < 0.8:
        return dataclasses.replace(a, chunked=True, body=a.body + (b"X" * r.randint(0, 9) if r.random() < 0.5 else b""))
    elif roll < 0.9 and data and a.body:  # a data range's bytes changed: only verify=True can tell
        body = bytearray(a.body)
        body[r.randrange(len(body))] ^= 1 << r.randrange(8)
        return dataclasses.replace(a, headers=h, body=bytes(body))
    else:
        return dataclasses.replace(a, headers=h, body=a.body[: r.randrange(len(a.body) + 1)])
    return dataclasses.replace(a, headers=h)


@pytest.mark.slow
def test_fuzz_http_responses(tmp_path, monkeypatch):
    monkeypatch.setenv("NNX_SAVE_HTTP_TIMEOUT", "1")  # a body shorter than its Content-Length waits this long
    expected = {
        "w": np.arange(4096, dtype=np.float32).reshape(64, 64),
        "b": np.arange(100, dtype=np.int16),
        "e": np.zeros((0, 3), np.float32),
    }
    nnx_save.save_file(expected, tmp_path / "m.safetensors")
    data = (tmp_path / "m.safetensors").read_bytes()

    with HostileServer({"/m.safetensors": data}) as server:
        server.etags["/m.safetensors"] = '"v1"'

        def make(rng: random.Random) -> Callable[[Request, Answer], Answer]:
            return lie_with(rng)

        def run(lie: Callable[[Request, Answer], Answer]) -> None:
            server.lie, server.requests = lie, []
            out = nnx_save.load_file(
                f"{server.url}/m.safetensors", verify=True, read_chunk_bytes=8 << 10, num_threads=2
            )
            assert sorted(out) == sorted(expected)
            check_exact(out, expected, lambda k: k)

        stats = fuzz(400, 90.0, make, run)
    print(f"\nHTTP responses: {stats}")
    assert stats["inputs"] >= 100 and stats["accepted"] >= 10 and len(stats["refused"]) >= 2, stats
