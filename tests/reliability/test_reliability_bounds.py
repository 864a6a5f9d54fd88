"""Parsers of foreign bytes are bounded: a TorchScript archive of
a few KiB that claims gigabytes of memo entries, code or nesting, and a zip whose zip64
locator points past the end of the file, each answer a typed NnxSaveError within
seconds in a process whose address space is capped at 1 GiB over what it holds after
its imports."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
import textwrap
import zipfile

import pytest

_RUN = """
import json, resource, sys, time
import numpy, nnx_save
from nnx_save.cli._main import main
from nnx_save.errors import NnxSaveError
call, path = sys.argv[1], sys.argv[2]
size = int(open("/proc/self/statm").read().split()[0]) * resource.getpagesize()
resource.setrlimit(resource.RLIMIT_AS, (size + (1 << 30), resource.RLIM_INFINITY))
open("/proc/self/clear_refs", "w").write("5")  # the peak resident size (VmHWM) restarts from here
before = int(open("/proc/self/status").read().split("VmRSS:")[1].split()[0]) << 10
t0 = time.monotonic()
calls = {
    "read_header": lambda: nnx_save.read_header(path),
    "load_file": lambda: nnx_save.load_file(path),
    "safe_open": lambda: nnx_save.safe_open(path),
    "convert": lambda: nnx_save.convert(path, path + ".out.safetensors"),
    "inspect": lambda: main(["inspect", path]),
}
try:
    out = calls[call]()
    result = "returned " + repr(out)[:200]
except NnxSaveError as e:
    result = "typed " + type(e).__name__ + ": " + str(e)[:300]
except BaseException as e:
    result = "FOREIGN " + type(e).__name__ + ": " + str(e)[:300]
peak = int(open("/proc/self/status").read().split("VmHWM:")[1].split()[0]) << 10
print(json.dumps({"result": result, "seconds": time.monotonic() - t0, "grew": peak - before}))
"""


def _capped(call: str, path) -> dict:
    """``call`` on ``path`` in a fresh process under the address-space cap."""
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_RUN), call, str(path)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _archive(path, data_pkl: bytes, code: bytes = b"class Net(Module):\n  __parameters__ = []\n") -> None:
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as z:
        z.writestr("net/data.pkl", data_pkl)
        z.writestr("net/code/__torch__.py", code)
        z.writestr("net/constants.pkl", b"\x80\x02).")
        z.writestr("net/version", b"3\n")


def _memoize(path) -> str:
    _archive(path, b"\x80\x02N" + b"\x94" * ((64 << 20) - 8) + b".")
    return "more than 1048576 memo entries (a limit of this reader)"


def _code(path) -> str:
    _archive(path, b"\x80\x02N.", code=b"x = 1\n" * ((64 << 20) // 6))
    return "net/code/ holds 67108860 bytes of code; at most 16777216 are parsed"


def _nested(path) -> str:
    # a module Net whose declared parameter "w" is a call of a value nested 200,000 tuples deep
    deep = b")" + b"\x85" * 200_000 + b")R"
    data = b"\x80\x02c__torch__\nNet\n)R}X\x01\x00\x00\x00w" + deep + b"sb."
    _archive(path, data, code=b'class Net(Module):\n  __parameters__ = ["w"]\n')
    return "values nested more than 1000 deep (a limit of this reader)"


def _zip64(path) -> str:
    locator = b"PK\x06\x07" + struct.pack("<IQI", 0, 2**64 - 1, 1)
    end = b"PK\x05\x06" + struct.pack("<HHHHIIH", 0, 0, 0xFFFF, 0xFFFF, 0xFFFFFFFF, 0xFFFFFFFF, 0)
    path.write_bytes(b"PK\x03\x04" + b"\x00" * (100 - 4 - len(locator) - len(end)) + locator + end)
    return "this is a zip archive"


@pytest.mark.parametrize("make", [_memoize, _code, _nested], ids=["memoize", "code", "nested"])
def test_hostile_torchscript_is_refused_within_bounds(tmp_path, make):
    path = tmp_path / "net.pt"
    message = make(path)
    assert path.stat().st_size < 1 << 20  # a small archive claiming far more
    got = _capped("convert", path)
    assert got["result"].startswith("typed ConvertError") and message in got["result"], got
    assert got["seconds"] < 20 and got["grew"] < 256 << 20, got


@pytest.mark.parametrize("call", ["read_header", "load_file", "safe_open", "inspect", "convert"])
def test_zip64_locator_past_the_end_is_typed(tmp_path, call):
    path = tmp_path / "z.safetensors"
    message = _zip64(path)
    got = _capped(call, path)
    if call == "inspect":  # the CLI answers with its error line and exit status 2
        assert got["result"] == "returned 2", got
    else:
        assert got["result"].startswith("typed "), got
        assert call == "convert" or message in got["result"], got
