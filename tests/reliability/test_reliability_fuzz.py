"""Fuzzing the header parser and ``load_file`` with mutated real files.

A seeded, structure-aware mutation fuzzer (no extra dependency, deterministic):
seeds are real files written by ``save_file`` and ``save_model`` (every kind of
dtype, scalars, empty tensors, metadata, checksums); each input applies one to
four mutations drawn from byte-level ones (bit flips, interesting bytes, digits,
insertions, deletions, truncation, appended bytes, a lying size prefix, splices
between seeds) and JSON-level ones (a tensor's shape, offsets or dtype replaced by
hostile values, entries dropped or duplicated, metadata made non-string, the
header re-encoded with a correct prefix so the deeper checks are reached).

The contract checked on every input: the call returns, or raises a library error
(an :class:`~nnx_save.NnxSaveError`; ``FileNotFoundError`` for a missing file);
never another exception, and never a hang (a per-input alarm, and the slowest input
is reported). Failing inputs are written next to the test's temporary directory.

- ``test_fuzz_header_parser``: 100,000 inputs through ``header_size`` + ``parse_header``, in-process.
- ``test_fuzz_load_file``: up to 100,000 inputs (the same seeded sequence, cut
  at ``LOAD_BUDGET_S`` of wall time, at least 20,000) written to a file and loaded
  with ``load_file`` (every other one with ``verify=True``) and ``read_header``:
  about 2 ms per input, so 100,000 take ~40 s on an idle machine.
"""

from __future__ import annotations

import json
import os
import random
import signal
import struct
import time
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from flax import nnx

import nnx_save
from nnx_save.format._header import header_size, parse_header

SEED = 1129
PARSER_INPUTS = 100_000
LOAD_INPUTS = 100_000
LOAD_BUDGET_S = 100.0
LOAD_MIN_INPUTS = 20_000
PER_INPUT_LIMIT_S = 5.0  # far above any real input (ms); only a hang reaches it

INTERESTING_INTS = [
    0,
    1,
    -1,
    2,
    3,
    7,
    8,
    255,
    256,
    2**31 - 1,
    2**31,
    2**32,
    2**53 + 1,
    2**63 - 1,
    2**63,
    2**64,
    10**12,
    -(2**63),
    10**30,
]
INTERESTING_JSON = [
    *INTERESTING_INTS,
    1.5,
    -0.0,
    1e308,
    "x",
    "",
    None,
    True,
    False,
    [],
    {},
    [1, 2],
    {"a": 1},
    [[0]],
    "F32",
    "BOOL",
]
DTYPES = [
    "F64",
    "F32",
    "F16",
    "BF16",
    "I64",
    "I32",
    "I16",
    "I8",
    "U8",
    "U16",
    "U32",
    "U64",
    "BOOL",
    "F8_E4M3",
    "F8_E5M2",
    "F4",
    "C64",
    "X9",
    "",
]
BYTES = b'\x00\xff"{}[],:-0123456789 .eE\\\x80\xc3'


def seed_files(directory: Path) -> list[bytes]:
    trees = [
        {
            "w": np.arange(6, dtype=np.float32).reshape(2, 3),
            "h": np.ones(3, np.float16),
            "b": np.array([True, False]),
            "e": np.zeros((0, 2), np.int64),
            "s": np.array(5, np.int8),
            "f4": np.zeros(4, ml_dtypes.float4_e2m1fn),
            "bf": np.full((2, 2), 1.5, ml_dtypes.bfloat16),
            "u": np.arange(3, dtype=np.uint64),
        },
        {"layers": [{"kernel": np.full((3, 2), 0.5, np.float64)}, {"kernel": np.zeros((2, 1), np.int32)}]},
        {"only": np.array(3.0, np.float32)},
    ]
    blobs = []
    for i, tree in enumerate(trees):
        path = directory / f"seed{i}.safetensors"
        nnx_save.save_file(tree, path, metadata={"note": f"seed {i}"})
        blobs.append(path.read_bytes())
    path = directory / "model.safetensors"
    nnx_save.save_model(nnx.Sequential(nnx.Linear(3, 4, rngs=nnx.Rngs(0)), nnx.Linear(4, 2, rngs=nnx.Rngs(1))), path)
    blobs.append(path.read_bytes())
    return blobs


def split(blob: bytes) -> tuple[dict | None, bytes]:
    """The header object (or None if it is not one) and the data section."""
    try:
        (n,) = struct.unpack("<Q", blob[:8])
        return json.loads(blob[8 : 8 + n]), blob[8 + n :]
    except (ValueError, struct.error):
        return None, b""


def join(header: object, data: bytes, rng: random.Random) -> bytes:
    text = json.dumps(header).encode()
    if rng.random() < 0.5:
        text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + data


def json_mutation(blob: bytes, rng: random.Random) -> bytes:
    header, data = split(blob)
    if not isinstance(header, dict) or not header:
        return blob
    names = list(header)
    name = rng.choice(names)
    entry = header[name]
    op = rng.randrange(9)
    if op == 0 and isinstance(entry, dict):  # a hostile shape
        entry["shape"] = (
            [rng.choice([*INTERESTING_INTS, 1, 2, 3, 4]) for _ in range(rng.randrange(4))]
            if rng.random() < 0.8
            else rng.choice(INTERESTING_JSON)
        )
    elif op == 1 and isinstance(entry, dict):  # hostile offsets
        entry["data_offsets"] = (
            [rng.choice(INTERESTING_INTS) for _ in range(rng.choice([2, 2, 2, 1, 3]))]
            if rng.random() < 0.8
            else rng.choice(INTERESTING_JSON)
        )
    elif op == 2 and isinstance(entry, dict):
        entry["dtype"] = rng.choice(DTYPES) if rng.random() < 0.9 else rng.choice(INTERESTING_JSON)
    elif op == 3:
        del header[name]
    elif op == 4:
        header[name + "_copy"] = entry
    elif op == 5:
        header["__metadata__"] = rng.choice(
            [
                {"k": rng.choice(INTERESTING_JSON)},
                rng.choice(INTERESTING_JSON),
                {"nnx_save.checksums": rng.choice(['{"w": 1}', "[]", "{", '{"w":"zz"}'])},
            ]
        )
    elif op == 6 and isinstance(entry, dict):  # drop or add a field
        if entry and rng.random() < 0.5:
            del entry[rng.choice(list(entry))]
        else:
            entry[rng.choice(["extra", "dtype", "shape"])] = rng.choice(INTERESTING_JSON)
    elif op == 7:
        header[name] = rng.choice(INTERESTING_JSON)
    else:  # a header that is valid JSON but no object
        return join(rng.choice(INTERESTING_JSON), data, rng)
    return join(header, data, rng)


def byte_mutation(blob: bytearray, rng: random.Random, seeds: list[bytes]) -> bytearray:
    op = rng.randrange(10)
    n = len(blob)
    if op == 0 and n:
        blob[rng.randrange(n)] ^= 1 << rng.randrange(8)
    elif op == 1 and n:
        blob[rng.randrange(n)] = rng.choice(BYTES)
    elif op == 2:  # a digit inside the header: shapes and offsets
        digits = [i for i in range(8, min(n, 4096)) if 48 <= blob[i] <= 57]
        if digits:
            blob[rng.choice(digits)] = rng.choice(b"0123456789-")
    elif op == 3:
        i = rng.randrange(n + 1)
        blob[i:i] = bytes(rng.choice(BYTES) for _ in range(rng.randrange(1, 9)))
    elif op == 4 and n:
        i = rng.randrange(n)
        del blob[i : i + rng.randrange(1, 17)]
    elif op == 5:
        del blob[rng.randrange(n + 1) :]
    elif op == 6:
        blob += bytes(rng.randrange(1, 64))
    elif op == 7 and n >= 8:  # a lying size prefix
        (size,) = struct.unpack("<Q", blob[:8])
        blob[:8] = struct.pack(
            "<Q", rng.choice([rng.randrange(2**64), max(size + rng.randrange(-16, 17), 0), n - 8, n, 0, 100_000_001])
        )
    elif op == 8:  # splice another seed's tail
        other = rng.choice(seeds)
        i, j = rng.randrange(n + 1), rng.randrange(len(other) + 1)
        blob[i:] = other[j:]
    else:  # duplicate a chunk
        if n:
            i = rng.randrange(n)
            blob[i:i] = blob[i : i + rng.randrange(1, 32)]
    return blob


def mutate(seeds: list[bytes], rng: random.Random) -> bytes:
    blob = rng.choice(seeds)
    for _ in range(rng.randrange(1, 5)):
        if rng.random() < 0.4:
            blob = json_mutation(bytes(blob), rng)
        else:
            blob = bytes(byte_mutation(bytearray(blob), rng, seeds))
    return blob


class Hang(BaseException):
    pass


def _alarm(signum, frame):
    raise Hang()


def fuzz(count: int, run_one, seeds: list[bytes], crashes: Path, budget_s: float = float("inf")) -> dict:
    """Run ``count`` mutated inputs (fewer if ``budget_s`` runs out) through
    ``run_one``; return statistics. Fails on the first input raising anything but
    a library error, or running too long."""
    rng = random.Random(SEED)
    stats = {"inputs": 0, "accepted": 0, "refused": {}, "slowest_s": 0.0}
    previous = signal.signal(signal.SIGALRM, _alarm)
    t0 = time.monotonic()
    try:
        for i in range(count):
            if time.monotonic() - t0 > budget_s:
                break
            blob = mutate(seeds, rng)
            start = time.perf_counter()
            signal.setitimer(signal.ITIMER_REAL, PER_INPUT_LIMIT_S)
            try:
                run_one(blob, i)
                stats["accepted"] += 1
            except (nnx_save.NnxSaveError, FileNotFoundError) as e:
                kind = type(e).__name__ + (f"({e.check})" if getattr(e, "check", None) else "")  # one per header check
                stats["refused"][kind] = stats["refused"].get(kind, 0) + 1
            except BaseException as e:
                signal.setitimer(signal.ITIMER_REAL, 0)
                crashes.mkdir(parents=True, exist_ok=True)
                (crashes / f"input{i}.safetensors").write_bytes(blob)
                what = "hang (over the per-input limit)" if isinstance(e, Hang) else f"{type(e).__name__}: {e}"
                raise AssertionError(f"input {i} ({crashes / f'input{i}.safetensors'}): {what}\n{blob[:300]!r}") from e
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
            stats["slowest_s"] = max(stats["slowest_s"], time.perf_counter() - start)
            stats["inputs"] += 1
    finally:
        signal.signal(signal.SIGALRM, previous)
    stats["seconds"] = round(time.monotonic() - t0, 1)
    return stats


@pytest.fixture(scope="module")
def seeds(tmp_path_factory):
    return seed_files(tmp_path_factory.mktemp("seeds"))


@pytest.mark.slow
def test_fuzz_header_parser(seeds, tmp_path):
    def run_one(blob: bytes, i: int) -> None:
        n = header_size(blob[:8], len(blob))
        parse_header(blob[8 : 8 + n], len(blob))

    stats = fuzz(PARSER_INPUTS, run_one, seeds, tmp_path / "crashes")
    print(f"\nheader parser: {stats}")
    assert stats["inputs"] == PARSER_INPUTS
    assert stats["accepted"] > 1000 and len(stats["refused"]) >= 8, stats  # the fuzzer reaches both sides


@pytest.mark.slow
def test_fuzz_load_file(seeds, tmp_path):
    shm = Path("/dev/shm")
    directory = Path(os.path.realpath(shm)) if shm.is_dir() and os.access(shm, os.W_OK) else tmp_path
    path = directory / f"nnx_save_fuzz_{os.getpid()}.safetensors"

    def run_one(blob: bytes, i: int) -> None:
        path.write_bytes(blob)
        nnx_save.read_header(path)
        nnx_save.load_file(path, verify=bool(i % 2))

    try:
        stats = fuzz(LOAD_INPUTS, run_one, seeds, tmp_path / "crashes", LOAD_BUDGET_S)
    finally:
        path.unlink(missing_ok=True)
    print(f"\nload_file: {stats}")
    assert stats["inputs"] >= LOAD_MIN_INPUTS, stats
    assert stats["accepted"] > 300 and "ChecksumError" in stats["refused"], stats
