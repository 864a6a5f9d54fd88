"""The front door answers with typed errors: numbers and paths
from outside are checked where they enter, a call with its arguments swapped or of the
wrong kind is an OptionError naming the argument, a missing source is the documented
SourceNotFoundError, a multi-file save over a file is a SaveError, and nothing is printed
at interpreter exit. (The generated sweep over the whole surface: test_contract_surface.py.)"""

from __future__ import annotations

import contextlib
import io
import re
import subprocess
import sys

import numpy as np
import pytest
from flax import nnx

import nnx_save
from nnx_save.cli import main as cli_main
from nnx_save.errors import OptionError, SaveError, SourceNotFoundError

NINES = "9" * 400
TREE = {"w": np.ones((2, 3), np.float32)}


def _model() -> nnx.Module:
    return nnx.Linear(2, 3, rngs=nnx.Rngs(0))


def test_huge_sizes_and_counts_are_option_errors(tmp_path):
    """Item 9: a size of 400 nines (an OverflowError from float arithmetic) and its kind."""
    src = tmp_path / "a.safetensors"
    nnx_save.save_file(TREE, src)
    size = re.escape(f"max_shard_size='{'9' * 76}...: expected a positive number of bytes up to 2**62")
    with pytest.raises(OptionError, match=size):
        nnx_save.SaveOptions(max_shard_size=NINES)
    with pytest.raises(OptionError, match=size):
        nnx_save.save_file(TREE, tmp_path / "o", max_shard_size=NINES)
    with pytest.raises(OptionError, match=size):
        nnx_save.convert(src, tmp_path / "c", max_shard_size=NINES)
    with pytest.raises(OptionError, match=re.escape("max_shard_size=4611686018427387905: expected")):
        nnx_save.save_file(TREE, tmp_path / "o", max_shard_size=(1 << 62) + 1)
    with pytest.raises(OptionError, match=re.escape("max_over_read_ratio must be >= 1.0")):
        nnx_save.LoadOptions(max_over_read_ratio=10**400)
    with pytest.raises(OptionError, match=re.escape("num_threads must be 1 to 4096, got 10000000000")):
        nnx_save.load_file(src, num_threads=10**10)
    with pytest.raises(OptionError, match=re.escape("wait_for_saves: timeout must be None or seconds between 0")):
        nnx_save.wait_for_saves(10**400)
    with pytest.raises(OptionError, match=re.escape("max_batch_bytes must be a positive int (bytes) up to 2**62")):
        list(nnx_save.iter_tensors(src, max_batch_bytes=2**64))
    err = io.StringIO()
    with contextlib.redirect_stderr(err), pytest.raises(SystemExit) as exited:
        cli_main(["convert", str(src), str(tmp_path / "d"), "--max-shard-size", NINES])
    assert exited.value.code == 2
    assert err.getvalue().splitlines()[-1].startswith("nnx-save: error: argument --max-shard-size: '999")
    assert not (tmp_path / "o").exists() and not (tmp_path / "c").exists() and not (tmp_path / "d").exists()


def test_swapped_and_foreign_arguments_are_option_errors(tmp_path):
    """Item 10: save_model(a_dict) was an AttributeError, save_model(path, model) an
    IndexError, load_model(path, model) a TypeError; a path with a NUL byte a ValueError."""
    path = tmp_path / "m.safetensors"
    with pytest.raises(OptionError, match=re.escape("save_model: model must be an NNX object (an nnx.Module")):
        nnx_save.save_model(TREE, path)
    with pytest.raises(OptionError, match=re.escape("got str; the arguments are (model, path)")):
        nnx_save.save_model(str(path), _model())
    nnx_save.save_model(_model(), path)
    with pytest.raises(OptionError, match=re.escape("got PosixPath; the arguments are (model_or_builder, source)")):
        nnx_save.load_model(path, _model())
    with pytest.raises(OptionError, match=re.escape("save_file: path must be a path with no NUL byte")):
        nnx_save.save_file(TREE, str(tmp_path / "a\x00b"))
    with pytest.raises(OptionError, match=re.escape("read_header: source must be a path (a non-empty str or os")):
        nnx_save.load_file(5)
    with pytest.raises(OptionError, match=re.escape("whose names have at most 255")):
        nnx_save.save_file(TREE, tmp_path / ("x" * 300))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.safetensors"]


def test_a_missing_source_is_source_not_found(tmp_path):
    """Item 10: the docs promise SourceNotFoundError (a FileNotFoundError) for every reader."""
    missing = tmp_path / "missing.safetensors"
    for read in (nnx_save.load_file, nnx_save.read_header, lambda p: nnx_save.load_model(_model, p)):
        with pytest.raises(SourceNotFoundError, match=re.escape(f"{missing}: no such checkpoint file or directory")):
            read(missing)
    nnx_save.save_file(TREE, tmp_path / "a.safetensors")
    with pytest.raises(SourceNotFoundError, match=re.escape(f"{missing}: no such checkpoint file or directory")):
        nnx_save.load_file([tmp_path / "a.safetensors", missing])


def test_a_multi_file_save_over_a_file_is_a_save_error(tmp_path):
    """Item 10: multi-file and pod saves into an existing file were FileExistsError /
    NotADirectoryError; the file is left as it was."""
    file = tmp_path / "taken"
    file.write_text("keep me")
    message = re.escape(f"{file}: exists and is not a directory; a multi-file or pod save writes a directory there")
    with pytest.raises(SaveError, match=message):
        nnx_save.save_file(TREE, file, max_shard_size=100)
    with pytest.raises(SaveError, match=message):
        nnx_save.save_pod(TREE, file)
    with pytest.raises(SaveError, match=re.escape(f"{file / 'x'}: cannot create the checkpoint directory")):
        nnx_save.save_pod(TREE, file / "x")
    assert file.read_text() == "keep me"


def test_nothing_is_printed_at_interpreter_exit(tmp_path):
    """Item 10: a header and handles alive at exit printed 'Exception ignored in
    Pinned.__del__ ... AttributeError'."""
    path = tmp_path / "h.safetensors"
    nnx_save.save_file(TREE, path)
    code = (
        "import nnx_save\n"
        f"h = nnx_save.read_header({str(path)!r})\n"
        f"f = nnx_save.safe_open({str(path)!r}); f.get_tensor('w')\n"
        f"g = nnx_save.safe_open({str(path)!r}, backend='pread'); g.get_tensor('w')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stderr == "", done.stderr


def test_save_pod_to_a_url_is_refused(tmp_path, monkeypatch):
    """save_pod(tree, "http://...") wrote a local directory named "http:" under the cwd."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(OptionError, match=re.escape("save_pod: directory 'http://127.0.0.1:9/m?x=1' is a URL")):
        nnx_save.save_pod(TREE, "http://127.0.0.1:9/m?x=1")
    assert list(tmp_path.iterdir()) == []
