"""Every NNX_SAVE_* environment variable is read, validated and documented in one place
(nnx_save/_config.py, docs/configuration.md); a bad value is a ConfigError naming the
variable, raised where it is used and not at import."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

import nnx_save
from nnx_save import _config
from nnx_save.errors import ConfigError, NnxSaveError

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "nnx_save"
NAMES = [v.name for v in _config.VARIABLES]


def _table_rows() -> list[tuple[str, ...]]:
    text = (ROOT / "docs" / "configuration.md").read_text(encoding="utf-8")
    rows = [line for line in text.splitlines() if line.startswith("| `NNX_SAVE_")]
    return [tuple(cell.strip() for cell in row.strip("|").split(" | ")) for row in rows]


def test_the_docs_table_is_the_config_module():
    expected = [(f"`{v.name}`", f"`{_default_text(v.default)}`", v.expected, v.meaning) for v in _config.VARIABLES]
    assert _table_rows() == expected
    assert len(NAMES) == len(set(NAMES)) == 11


def test_every_variable_named_in_the_package_is_in_the_table():
    named = {m for file in SRC.rglob("*.py") for m in re.findall(r"NNX_SAVE_[A-Z0-9_]+", file.read_text())}
    assert named == set(NAMES) | {old for v in _config.VARIABLES for old in v.replaces}


def test_only_the_config_module_reads_the_environment():
    readers = sorted(
        str(file.relative_to(SRC))
        for file in SRC.rglob("*.py")
        if file.name != "_config.py" and re.search(r"os\.(environ|getenv)\b|environ\.get", file.read_text())
    )
    assert readers == []


@pytest.mark.parametrize("variable", _config.VARIABLES, ids=NAMES)
def test_a_bad_value_names_the_variable_the_expectation_and_the_value(variable, monkeypatch):
    monkeypatch.setenv(variable.name, "bogus")
    with pytest.raises(ConfigError, match=re.escape(f"{variable.name}='bogus': expected {variable.expected}")) as info:
        variable.get()
    assert isinstance(info.value, NnxSaveError) and isinstance(info.value, ValueError)
    assert (info.value.variable, info.value.found) == (variable.name, "bogus")
    monkeypatch.setenv(variable.name, "")
    assert variable.get() == variable.default
    monkeypatch.delenv(variable.name)
    assert variable.get() == variable.default


@pytest.mark.parametrize(
    ("variable", "text", "value"),
    [
        (_config.STREAM, " ON ", True),
        (_config.STREAM, "auto", None),
        (_config.STREAM, "0", False),
        (_config.STAGING, "Pinned", "pinned"),
        (_config.HTTP_TIMEOUT, "0.5", 0.5),
        (_config.MAX_ASYNC_SAVES, "3", 3),
        (_config.FORCE_HOST_STAGING, "yes", True),
        (_config.PROGRESS_MIN_BYTES, "0", 0),
    ],
)
def test_good_values_parse(variable, text, value, monkeypatch):
    monkeypatch.setenv(variable.name, text)
    assert variable.get() == value


@pytest.mark.parametrize(
    ("variable", "text"),
    [
        (_config.HTTP_TIMEOUT, "0"),
        (_config.HTTP_TIMEOUT, "inf"),
        (_config.COLLECTIVE_TIMEOUT_S, "-1"),
        (_config.COLLECTIVE_TIMEOUT_S, "nan"),
        (_config.MAX_ASYNC_SAVES, "1.5"),
        (_config.SAVE_INFLIGHT_BYTES, "0"),
        (_config.PROGRESS_MIN_BYTES, "-1"),
        (_config.FORCE_HOST_STAGING, "2"),
    ],
)
def test_out_of_range_values_are_refused(variable, text, monkeypatch):
    monkeypatch.setenv(variable.name, text)
    with pytest.raises(ConfigError, match=re.escape(f"{variable.name}={text!r}: expected {variable.expected}")):
        variable.get()


def test_a_bad_value_is_refused_where_it_is_used_not_at_import(tmp_path):
    """Before, NNX_SAVE_PROGRESS_MIN_BYTES was parsed when nnx_save._progress was
    imported: a bad value broke every save and load with a bare ValueError."""
    path = tmp_path / "w.safetensors"
    code = (
        "import numpy as np, nnx_save\n"
        f"path = {str(path)!r}\n"
        "nnx_save.save_file({'w': np.ones(3, np.float32)}, path, progress=False)\n"
        "try:\n"
        "    nnx_save.save_file({'w': np.ones(3, np.float32)}, path)\n"
        "except nnx_save.errors.ConfigError as e:\n"
        "    print('refused:', e)\n"
    )
    env = {**os.environ, "NNX_SAVE_PROGRESS_MIN_BYTES": "lots", "JAX_PLATFORMS": "cpu"}
    env["PYTHONPATH"] = os.pathsep.join([str(SRC.parent), env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "refused: NNX_SAVE_PROGRESS_MIN_BYTES='lots': expected a number of bytes, 0 or more" in done.stdout
    assert path.exists()


def test_the_modules_read_their_variables_through_config(tmp_path, monkeypatch):
    from nnx_save.io import _kv
    from nnx_save.save import _collective

    monkeypatch.setenv("NNX_SAVE_COLLECTIVE_TIMEOUT_S", "soon")
    sync = _collective.Sync(tmp_path / "w.safetensors", _kv.Channel(0, 2, object()))  # read before any wait
    with pytest.raises(ConfigError, match=re.escape("NNX_SAVE_COLLECTIVE_TIMEOUT_S='soon'")):
        sync.gather("agree", None)
    monkeypatch.setenv("NNX_SAVE_MAX_ASYNC_SAVES", "-2")
    with pytest.raises(ConfigError, match=re.escape("NNX_SAVE_MAX_ASYNC_SAVES='-2': expected a positive integer")):
        nnx_save.save_file({"w": np.ones(2)}, tmp_path / "w.safetensors", blocking=False)
    monkeypatch.delenv("NNX_SAVE_MAX_ASYNC_SAVES")
    monkeypatch.setenv("NNX_SAVE_FORCE_HOST_STAGING", "maybe")
    with pytest.raises(ConfigError, match=re.escape("NNX_SAVE_FORCE_HOST_STAGING='maybe': expected 1 or 0")):
        nnx_save.save_file({"w": jnp.ones(2)}, tmp_path / "w.safetensors")  # asked only of jax arrays
    assert not os.listdir(tmp_path)
    monkeypatch.delenv("NNX_SAVE_FORCE_HOST_STAGING")
    monkeypatch.setenv("NNX_SAVE_STAGING", "fast")
    nnx_save.save_file({"w": np.ones(2)}, tmp_path / "w.safetensors")
    with pytest.raises(ConfigError, match=re.escape("NNX_SAVE_STAGING='fast': expected auto, pinned or pageable")):
        nnx_save.load_file(tmp_path / "w.safetensors", {"w": jnp.zeros(2)}, stream=True)


def test_the_store_waits_as_long_as_every_other_exchange(monkeypatch):
    """One timeout bounds every wait on another process, the store's decisions included;
    the variable the store once read is refused, naming its replacement, not ignored."""
    from nnx_save.checkpoint import _agree
    from nnx_save.io import _kv

    channel = _kv.Channel(1, 2, object())  # read before any wait
    monkeypatch.setenv("NNX_SAVE_COLLECTIVE_TIMEOUT_S", "soon")
    with pytest.raises(ConfigError, match=re.escape("NNX_SAVE_COLLECTIVE_TIMEOUT_S='soon'")):
        _agree._exchange(channel, "k", "open", None)
    monkeypatch.delenv("NNX_SAVE_COLLECTIVE_TIMEOUT_S")
    monkeypatch.setenv("NNX_SAVE_STORE_TIMEOUT_S", "60")
    expected = "NNX_SAVE_STORE_TIMEOUT_S='60': expected it unset: NNX_SAVE_COLLECTIVE_TIMEOUT_S replaces it ("
    with pytest.raises(ConfigError, match=re.escape(expected)) as info:
        _agree._exchange(channel, "k", "open", None)
    assert (info.value.variable, info.value.found) == ("NNX_SAVE_STORE_TIMEOUT_S", "60")
    with pytest.raises(ConfigError, match=re.escape(expected)):
        _config.COLLECTIVE_TIMEOUT_S.get()  # the collective saves and shared reads refuse it too
    monkeypatch.setenv("NNX_SAVE_STORE_TIMEOUT_S", " ")
    assert _config.COLLECTIVE_TIMEOUT_S.get() == 1800.0  # empty means unset, as for every variable


@pytest.mark.parametrize("text", ["9" * 400, "1e400", "1e300", "nan"])
def test_numbers_from_the_environment_are_bounded(monkeypatch, text):
    """Item 9's kind in the environment: every numeric NNX_SAVE_* variable refuses a value
    no wait or count can hold (400 nines, 1e300) with a ConfigError naming it."""
    numeric = [v for v in _config.VARIABLES if isinstance(v.default, (int, float)) and not isinstance(v.default, bool)]
    assert len(numeric) == 6
    for variable in numeric:
        monkeypatch.setenv(variable.name, text)
        with pytest.raises(ConfigError, match=re.escape(f"{variable.name}=")):
            variable.get()
        monkeypatch.delenv(variable.name)


def _default_text(value: object) -> str:
    """A variable's default as the docs table shows it (``auto`` for ``None``)."""
    if value is None:
        return "auto"
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)
