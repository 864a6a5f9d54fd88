"""What a newcomer met on the first day: the README tour runs clean with the README's
own 8-device flag, tiny loads raise no OverReadWarning, a non-strict ``load_file``
with missing keys gives one typed error; and (slow) a built wheel installs into a
fresh environment and runs ``nnx-save inspect`` and the tour outside the repository."""

import os
import re
import shutil
import subprocess
import sys
import sysconfig
import warnings
from pathlib import Path

import jax
import numpy as np
import pytest

import nnx_save

ROOT = Path(__file__).resolve().parents[2]


def _tour() -> str:
    text = (ROOT / "README.md").read_text()
    return text.split("## Five-minute tour", 1)[1].split("```python", 1)[1].split("```", 1)[0]


def test_readme_tour_runs_clean(tmp_path, monkeypatch):
    """The tour, as written, under this suite's 8 CPU devices: no warning at all."""
    assert jax.device_count() == 8  # the README's flag, set by conftest
    monkeypatch.chdir(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        exec(compile(_tour(), "README tour", "exec"), {"__name__": "tour"})
    assert (tmp_path / "model.safetensors").is_file() and (tmp_path / "w.safetensors").is_file()


def test_tiny_load_with_a_skipped_tensor_does_not_warn_over_read(tmp_path):
    """A 1.4 KiB file, one device, a skipped tensor between two loaded ones: the
    automatic merge reads through 768 bytes, which costs nothing: no OverReadWarning."""
    values = {
        "a.body": np.full((8, 8), 1.0, np.float32),
        "b.head": np.full((8, 24), 2.0, np.float32),
        "c.tail": np.full(16, 3.0, np.float32),
    }
    nnx_save.save_file(values, tmp_path / "small.safetensors")
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    abstract = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=one) for k, v in values.items() if k != "b.head"}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out, report = nnx_save.load_file(
            tmp_path / "small.safetensors", abstract, allow_unexpected=["b.head"], return_report=True
        )
    assert report.io.bytes_read > 2 * report.io.bytes_needed  # it did read through the head
    for key in abstract:
        np.testing.assert_array_equal(np.asarray(out[key]), values[key])


def test_non_strict_load_file_with_missing_keys_is_one_typed_error(tmp_path):
    nnx_save.save_file({"a": np.ones((2, 2), np.float32)}, tmp_path / "s.safetensors")
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    abstract = {
        "a": jax.ShapeDtypeStruct((2, 2), np.float32, sharding=one),
        "b": jax.ShapeDtypeStruct((3,), np.float32, sharding=one),
    }
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning first
        with pytest.raises(
            nnx_save.KeyMismatchError,
            match=re.escape("s.safetensors: 1 leaves of the abstract tree have no tensor in the checkpoint: ['b']"),
        ):
            nnx_save.load_file(tmp_path / "s.safetensors", abstract)
    with pytest.raises(nnx_save.LoadError, match=re.escape("missing: b")):  # strict: the report, as before
        nnx_save.load_file(tmp_path / "s.safetensors", abstract, strict=True)


@pytest.mark.slow
def test_wheel_installs_and_runs_outside_the_repo(tmp_path):
    """``pip wheel`` the checkout, install it into a fresh venv that reuses this
    environment's packages (no network), then run ``nnx-save inspect`` and the README
    tour from a directory outside the repository."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    clone = tmp_path / "clone"  # a copy: building writes build/ and *.egg-info next to the sources
    shutil.copytree(ROOT / "src", clone / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        if (ROOT / name).exists():
            shutil.copy(ROOT / name, clone / name)
    wheels = tmp_path / "wheels"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", str(wheels), str(clone)],
        check=True,
        capture_output=True,
        env=env,
        timeout=600,
    )
    (wheel,) = wheels.glob("nnx_save-*.whl")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    python = venv / "bin" / "python"
    # The dependencies come from this environment's site-packages, named in a .pth file
    # (the .pth files there, such as an editable install of this checkout, are not run).
    purelib = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    own = Path(subprocess.check_output([python, "-c", purelib], text=True).strip())
    (own / "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run(
        [python, "-m", "pip", "install", "--no-deps", "--no-index", str(wheel)],
        check=True,
        capture_output=True,
        env=env,
        timeout=600,
    )
    work = tmp_path / "elsewhere"
    work.mkdir()
    (work / "tour.py").write_text(_tour())
    run_env = {**env, "XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu"}
    where = subprocess.run(
        [python, "-W", "error", "tour.py"], cwd=work, env=run_env, capture_output=True, text=True, timeout=600
    )
    assert where.returncode == 0, where.stderr[-2000:]
    assert "model.safetensors: 4 loaded, 0 missing" in where.stdout and "8 shards of (4, 8)" in where.stdout
    imported = subprocess.check_output(
        [python, "-c", "import nnx_save; print(nnx_save.__file__)"], cwd=work, env=run_env, text=True
    )
    assert str(venv) in imported and str(ROOT) not in imported
    inspect = subprocess.run(
        [venv / "bin" / "nnx-save", "inspect", "model.safetensors"],
        cwd=work,
        env=run_env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert inspect.returncode == 0, inspect.stderr[-2000:]
    assert "layers.0.kernel" in inspect.stdout or "layers/0/kernel" in inspect.stdout, inspect.stdout[:2000]
