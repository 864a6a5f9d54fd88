"""Every ```python block of docs/*.md and README.md runs: each page's blocks in order,
in one namespace, in a fresh temporary directory. A block preceded by a
``<!-- skip -->`` line (blank lines between are allowed) is not run. Pages start
their own servers and processes (docs/remote.md: nginx, moto's S3 server;
docs/multihost.md: two JAX processes); whatever process a failing page leaves
running is ended."""

import builtins
import inspect
import os
import re
import subprocess
from pathlib import Path

import pytest

import nnx_save
import nnx_save.checkpoint
import nnx_save.porting

ROOT = Path(__file__).resolve().parents[1]
PAGES = [*sorted((ROOT / "docs").glob("*.md")), ROOT / "README.md"]
MULTIPROCESS_PAGES = {"multihost.md", "checkpoints.md"}  # run with the multi-process tests (tests/conftest.py)
FENCE = re.compile(r"^```(\w*)[ \t]*$")


def python_blocks(text: str) -> list[tuple[int, str]]:
    """``[(first line number, source)]`` of the runnable python blocks of a page."""
    blocks, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m or not m.group(1):
            i += 1
            continue
        start, lang = i, m.group(1)
        i += 1
        body = []
        while i < len(lines) and lines[i].rstrip() != "```":
            body.append(lines[i])
            i += 1
        i += 1
        before = [ln for ln in lines[:start] if ln.strip()]
        skipped = bool(before) and before[-1].strip() == "<!-- skip -->"
        if lang == "python" and not skipped:
            blocks.append((start + 2, "\n".join(body) + "\n"))
    return blocks


def test_block_extraction():
    page = (
        "a\n```python\nx = 1\n```\n<!-- skip -->\n\n```python\nboom()\n```\n```bash\nls\n```\n```python\ny = x\n```\n"
    )
    assert python_blocks(page) == [(3, "x = 1\n"), (14, "y = x\n")]


def _end_processes(namespace: dict) -> None:
    """End the processes a page left running (it failed before its own clean-up)."""
    for value in list(namespace.values()):
        for proc in value if isinstance(value, list) else [value]:
            if isinstance(proc, subprocess.Popen) and proc.poll() is None:
                proc.kill()
                proc.wait(timeout=30)


@pytest.mark.parametrize(
    "page",
    [
        pytest.param(p, marks=pytest.mark.multiprocess) if p.name in MULTIPROCESS_PAGES else p
        for p in PAGES
        if python_blocks(p.read_text(encoding="utf-8"))
    ],
    ids=lambda p: p.name,
)
def test_page_examples_run(page, tmp_path, monkeypatch):
    blocks = python_blocks(page.read_text(encoding="utf-8"))
    monkeypatch.chdir(tmp_path)
    namespace = {"__name__": f"docs_{page.stem}"}
    try:
        for line, source in blocks:
            code = compile(source, f"{page.relative_to(ROOT)}:{line}", "exec")
            exec(code, namespace)
    finally:
        _end_processes(namespace)


def test_index_links_every_page():
    index = (ROOT / "docs" / "index.md").read_text()
    pages = sorted(p.name for p in (ROOT / "docs").glob("*.md") if p.name != "index.md")
    assert "remote.md" in pages and "multihost.md" in pages
    assert [name for name in pages if f"]({name})" not in index] == []


def test_errors_page_names_every_public_error():
    text = (ROOT / "docs" / "errors.md").read_text()
    errors = {
        name
        for module in (nnx_save, nnx_save.checkpoint, nnx_save.porting)
        for name, obj in vars(module).items()
        if inspect.isclass(obj) and issubclass(obj, Exception) and not name.startswith("_")
    }
    assert "ChecksumError" in errors and "NnxSaveError" in errors
    assert sorted(e for e in errors if e not in text) == []


def test_cli_page_shows_the_captured_terminal():
    captured = (ROOT / "docs" / "progress.txt").read_text().splitlines()
    page = (ROOT / "docs" / "cli.md").read_text()
    assert all(line in page for line in captured if line != "DONE")
    assert os.path.exists(ROOT / "docs" / "progress.txt")


@pytest.mark.slow  # a fresh python with jax, as a user pastes the tour
@pytest.mark.parametrize("devices", [1, 3])
def test_readme_tour_runs_pasted_into_python(devices, tmp_path):
    """The README's python blocks, piped into a plain ``python`` on a machine with
    ``devices`` CPU devices (1: a laptop; 3: a count that divides nothing)."""
    import subprocess
    import sys

    source = "\n".join(src for _, src in python_blocks((ROOT / "README.md").read_text(encoding="utf-8")))
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(JAX_PLATFORMS="cpu", XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])
    done = subprocess.run(
        [sys.executable, "-"], input=source, text=True, capture_output=True, cwd=tmp_path, env=env, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"{devices} shards of (4, 8)" in done.stdout


def test_the_readme_layout_names_every_module_of_the_tree():
    """The README's layout block matches src/: each package and each module is named there
    (so a module moved or added without a word fails here), and the design page is linked."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    section = readme[readme.index("## Layout\n") :]
    block = section[section.index("```\n") : section.index("\n```", section.index("```\n") + 4)]
    src = ROOT / "src" / "nnx_save"
    unnamed = []
    for file in sorted(src.rglob("*.py")):
        rel = file.relative_to(src)
        if file.name == "__init__.py" and len(rel.parts) > 1:
            name = f"{rel.parts[0]}/"
        elif file.name in ("__init__.py", "__main__.py", "_version.py"):
            continue
        else:
            name = file.stem
        if not re.search(
            rf"(?<![\w/]){re.escape(name)}(?![\w/])" if not name.endswith("/") else re.escape(name), block
        ):
            unnamed.append(str(rel))
    assert unnamed == [], f"modules the README's layout section does not name: {unnamed}"
    assert "(docs/design.md)" in section


PACKAGES = "format|porting|io|load|save|layouts|bridges|checkpoint|conversion|cli"
QUALIFIED = re.compile(rf"(?<![\w/.])((?:{PACKAGES})/(?:_\w+)?)((?:\.\w+)*)")
CLASS_NAME = re.compile(r"`([A-Z][a-z]\w*)((?:\.\w+)?)`")  # CamelCase: not O_DIRECT
MISSING = object()


def _resolve(obj, attrs: str):
    """``obj``'s dotted attribute ``attrs`` (``".SavePlan.write_and_retire"``), a dataclass field or a
    Protocol's annotated member included; :data:`MISSING` where one is missing."""
    for attr in filter(None, attrs.split(".")):
        fields = getattr(obj, "__dataclass_fields__", {})
        if hasattr(obj, attr):
            obj = getattr(obj, attr)
        elif attr in fields or attr in getattr(obj, "__annotations__", {}):
            obj = fields.get(attr, attr)
        else:
            return MISSING
    return obj


def _package_classes() -> dict[str, list[str]]:
    """Every class defined in a module of the package: ``{name: [module, ...]}``."""
    import importlib
    import pkgutil

    found: dict[str, list[str]] = {}
    for info in pkgutil.walk_packages(nnx_save.__path__, "nnx_save."):
        if info.name == "nnx_save.__main__":  # runs the command line
            continue
        module = importlib.import_module(info.name)
        for name, value in vars(module).items():
            if inspect.isclass(value) and value.__module__ == info.name:
                found.setdefault(name, []).append(info.name)
    return found


def test_the_design_page_names_only_what_exists():
    """Every module, class, function, method and file docs/design.md names exists:
    ``io/_lock.WriterLock``, ``layouts/_registry.SavePlan.write_and_retire`` and ``save/`` resolved in the
    package, a bare class name (```Placement```, ```Location.commit```) found among its
    classes, and a named file of the repository present."""
    import importlib

    text = (ROOT / "docs" / "design.md").read_text(encoding="utf-8")
    missing = []
    for m in QUALIFIED.finditer(text):
        module_path, attrs = m.group(1), m.group(2)
        try:
            module = importlib.import_module("nnx_save." + module_path.rstrip("/").replace("/", "."))
        except ModuleNotFoundError:
            missing.append(m.group(0))
            continue
        if _resolve(module, attrs) is MISSING:
            missing.append(m.group(0))
    classes = _package_classes()
    for m in CLASS_NAME.finditer(text):
        name, attrs = m.groups()
        if name in vars(builtins):  # None, True
            continue
        owners = [importlib.import_module(module) for module in classes.get(name, [])]
        if not any(_resolve(getattr(module, name), attrs) is not MISSING for module in owners):
            missing.append(m.group(1) + m.group(2))
    for path in re.findall(r"`((?:benchmarks|tests|docs|src|examples)/[\w/.]+)`", text):
        if not (ROOT / path).exists():
            missing.append(path)
    assert missing == [], f"docs/design.md names what the package does not have: {missing}"
    assert len(set(QUALIFIED.findall(text))) >= 30  # the pattern still reads the page's references
