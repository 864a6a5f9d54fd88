"""The ``nnx-save`` command line: ``inspect``, ``verify``, ``diff`` and ``convert``.

Tensor data is read one tensor at a time, so memory stays bounded by the largest
tensor. Exit status: 0 when all holds, 1 when ``verify`` finds a problem or ``diff`` a
difference, 2 on a usage error or a checkpoint that cannot be read (docs/cli.md).
"""

from __future__ import annotations

import argparse
import dataclasses
import fnmatch
import json
import logging
import math
import os
import sys
from collections.abc import Iterator, Sequence
from typing import Any, NoReturn

import numpy as np

from .._version import __version__
from ..conversion._convert import batches, read_many, read_one
from ..errors import OptionError
from ..format import _units
from ..format._header import strict_json
from ..format._units import human_bytes

__all__ = ["main"]

_CHECKSUMS = "nnx_save.checksums"


def parse_size(text: str) -> int:
    """``"5GB"`` -> 5_000_000_000, ``"200MiB"`` -> 209_715_200, ``"1000"`` -> 1000."""
    try:
        return _units.parse_size(text, "--max-shard-size")
    except OptionError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size (examples: 5GB, 200MiB, 1000000)") from None


# ------------------------------------------------------------------------------- inspect


def _rows(header: Any, pattern: str | None) -> list[dict[str, Any]]:
    return [
        {
            "name": name,
            "dtype": t.dtype.code,
            "shape": list(t.shape),
            "numel": t.numel,
            "nbytes": t.nbytes,
            "file": t.file if header.kind == "file" else os.path.basename(t.file),
            "begin": t.begin,
            "end": t.end,
        }
        for name, t in header.tensors.items()
        if not pattern or fnmatch.fnmatchcase(name, pattern)
    ]


def _totals(rows: Sequence[dict[str, Any]]) -> dict[str, dict[str, int]]:
    out: dict[str, dict[str, int]] = {}
    for r in rows:
        d = out.setdefault(r["dtype"], {"tensors": 0, "parameters": 0, "bytes": 0})
        d["tensors"] += 1
        d["parameters"] += r["numel"]
        d["bytes"] += r["nbytes"]
    return dict(sorted(out.items()))


def _shown_metadata(metadata: dict[str, str]) -> dict[str, str]:
    out = {}
    for k, v in metadata.items():
        if k == _CHECKSUMS:
            try:
                v = f"<{len(strict_json(v))} xxh3_64 digests>"  # type: ignore[arg-type]
            except (ValueError, TypeError):  # not JSON, too deep, not a collection
                v = "<malformed>"
        out[k] = v if len(v) <= 100 else v[:97] + "..."
    return out


def _table(rows: Sequence[dict[str, Any]]) -> list[str]:
    cells = [["name", "dtype", "shape", "size", "file", "bytes"]]
    cells += [
        [r["name"], r["dtype"], str(r["shape"]), human_bytes(r["nbytes"]), r["file"], f"[{r['begin']}, {r['end']})"]
        for r in rows
    ]
    widths = [max(len(row[i]) for row in cells) for i in range(len(cells[0]))]
    return ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=False)).rstrip() for row in cells]


def cmd_inspect(args: argparse.Namespace) -> int:
    import nnx_save

    header = nnx_save.read_header(args.source)
    rows = _rows(header, args.filter)
    totals = _totals(rows)
    params, nbytes = sum(r["numel"] for r in rows), sum(r["nbytes"] for r in rows)
    metadata = dict(header.files[0].metadata) if header.kind != "file" and header.files else dict(header.metadata)
    if args.json:
        json.dump(
            {
                "source": str(args.source),
                "kind": header.kind,
                "files": [fh.file for fh in header.files],
                "tensors": rows,
                "totals": totals,
                "parameters": params,
                "bytes": nbytes,
                "metadata": metadata,
            },
            sys.stdout,
            indent=2,
        )
        sys.stdout.write("\n")
        return 0
    shown = (
        f"{len(rows)} of {len(header.tensors)} tensors match {args.filter!r}" if args.filter else f"{len(rows)} tensors"
    )
    print(f"{args.source}: {header.kind}, {len(header.files)} file(s), {shown}")
    if rows:
        print("\n".join(_table(rows)))
    print("\ntotals by dtype:")
    for code, d in totals.items():
        print(
            f"  {code:<8} {d['tensors']:>6} tensors  {d['parameters']:>15,} parameters  {human_bytes(d['bytes']):>10}"
        )
    print(f"parameters: {params:,} ({human_bytes(nbytes)})")
    if metadata:
        print("metadata:")
        for k, v in _shown_metadata(metadata).items():
            print(f"  {k}: {v}")
    return 0


# -------------------------------------------------------------------------------- verify


def _verify_file(header: Any, fh: Any, problems: list[str]) -> tuple[int, int]:
    """Check every checksum ``fh`` records; (verified, without a checksum)."""
    import nnx_save

    verified = unverified = 0
    for batch in batches(header, fh.tensors):  # one load per batch: linear in the tensor count
        try:
            _, report = read_many(header, batch, verify=True)
        except nnx_save.ChecksumError as e:
            if e.key is None:  # the checksum record itself is unreadable: nothing more to check here
                problems.append(str(e))
                return verified, unverified
            found = _verify_each(header, batch, problems)  # name every bad tensor of the batch
            verified, unverified = verified + found[0], unverified + found[1]
            continue
        verified += len(report.verified)
        unverified += len(report.unverified)
    return verified, unverified


def _verify_each(header: Any, keys: list[str], problems: list[str]) -> tuple[int, int]:
    """:func:`_verify_file` one tensor at a time, for a batch that holds a bad one."""
    import nnx_save

    verified = unverified = 0
    for key in keys:
        try:
            _, report = read_one(header, key, verify=True)
        except nnx_save.ChecksumError as e:
            problems.append(str(e))
            continue
        verified += len(report.verified)
        unverified += len(report.unverified)
    return verified, unverified


def cmd_verify(args: argparse.Namespace) -> int:
    import nnx_save

    try:
        header = nnx_save.read_header(args.source)
    except nnx_save.HeaderError as e:
        print(f"FAIL {e}")
        print(f"verify: {args.source}: header check failed; nothing else was checked")
        return 1
    problems: list[str] = []
    total_verified = total_unverified = 0
    for fh in header.files:
        before = len(problems)
        # A pod's shard file holds pieces, not the pod's tensors: its checksums are checked as the file it is.
        verified, unverified = _verify_file(
            nnx_save.read_header(fh.file) if header.kind == "pod" else header, fh, problems
        )
        total_verified, total_unverified = total_verified + verified, total_unverified + unverified
        status = "OK  " if len(problems) == before else "FAIL"
        print(
            f"{status} {fh.file}: header valid, {len(fh.tensors)} tensors, {verified} checksums verified"
            + (f", {unverified} without a checksum" if unverified else "")
        )
        for p in problems[before:]:
            print(f"FAIL {p}")
    for missing in header.missing_files:  # every load of a tensor with pieces there fails
        problems.append(f"{missing}: named by the checkpoint, not present in {args.source}")
        print(f"FAIL {problems[-1]}")
    if args.require_checksums and total_unverified:
        problems.append(f"{total_unverified} tensors have no checksum (--require-checksums)")
        print(f"FAIL {problems[-1]}")
    print(
        f"verify: {args.source}: {len(header.files)} file(s), {len(header.tensors)} tensors, "
        f"{total_verified} verified, {total_unverified} without a checksum, {len(problems)} problem(s)"
    )
    return 1 if problems else 0


# ---------------------------------------------------------------------------------- diff


@dataclasses.dataclass(frozen=True)
class ValueDiff:
    """How two same-shape tensors differ: ``worst`` is ``max |a - b|`` (an exact int for
    integer tensors; NaN where only one side is NaN), ``differing`` the count of elements
    beyond ``atol``, ``size`` the count compared."""

    worst: float | int
    differing: int
    size: int


def compare_values(a: np.ndarray, b: np.ndarray, atol: float = 0.0, chunk: int = 1 << 22) -> ValueDiff:
    """Compare ``a`` and ``b`` exactly, in chunks: integers as integers (no float64
    rounding), complex numbers in both parts, floats in float64 (exact for every float of
    64 bits or fewer). Equal infinities and NaN against NaN count as equal.

    Examples:
        >>> compare_values(np.array([2**60, 5]), np.array([2**60 + 1, 5]))
        ValueDiff(worst=1, differing=1, size=2)
        >>> compare_values(np.array([1 + 1j], np.complex64), np.array([1 + 2j], np.complex64))
        ValueDiff(worst=1.0, differing=1, size=1)
    """
    fa, fb = a.reshape(-1), b.reshape(-1)
    measure = _measure(fa.dtype, fb.dtype)
    worst: float | int = 0 if measure is _int_abs else 0.0
    differing = 0
    for i in range(0, fa.size, chunk):
        d = measure(fa[i : i + chunk], fb[i : i + chunk])
        differing += int(np.count_nonzero(~np.asarray(d <= atol, dtype=bool)))  # NaN is never <= atol
        if d.size:
            worst = _worse(worst, d)
    return ValueDiff(worst, differing, int(fa.size))


def _worse(worst: float | int, d: np.ndarray) -> float | int:
    if isinstance(worst, float) and math.isnan(worst):
        return worst
    if d.dtype == np.float64 and np.isnan(d).any():
        return math.nan
    top = d.max()
    return max(worst, top.item() if isinstance(top, np.generic) else top)


def _measure(x: np.dtype, y: np.dtype) -> Any:
    """The element-wise ``|a - b|`` for this pair of dtypes (0 where equal)."""
    if x.kind in "iub" and y.kind in "iub":
        return _int_abs
    if x.kind == "c" or y.kind == "c":
        return _complex_abs
    return _float_abs


def _int_abs(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Exact ``|x - y|`` of integers, as uint64 (it always fits), or Python ints when
    a uint64 meets a signed type (no common numpy type holds both)."""
    if np.uint64 in (x.dtype, y.dtype) and not (x.dtype.kind in "ub" and y.dtype.kind in "ub"):
        return np.abs(x.astype(object) - y.astype(object))
    if x.dtype.kind in "ub" and y.dtype.kind in "ub":
        ux, uy = x.astype(np.uint64), y.astype(np.uint64)
        return np.where(ux >= uy, ux - uy, uy - ux)
    sx, sy = x.astype(np.int64), y.astype(np.int64)
    ux, uy = sx.view(np.uint64), sy.view(np.uint64)
    return np.where(sx >= sy, ux - uy, uy - ux)  # modulo 2**64, exact since 0 <= |x - y| < 2**64


def _float_abs(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    fx, fy = x.astype(np.float64), y.astype(np.float64)
    same = (fx == fy) | (np.isnan(fx) & np.isnan(fy))
    with np.errstate(invalid="ignore", over="ignore"):
        return np.where(same, 0.0, np.abs(fx - fy))


def _complex_abs(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    cx, cy = x.astype(np.complex128), y.astype(np.complex128)
    with np.errstate(invalid="ignore", over="ignore"):
        return np.hypot(_float_abs(cx.real, cy.real), _float_abs(cx.imag, cy.imag))


def _diff_lines(ha: Any, hb: Any, atol: float) -> Iterator[tuple[str, str, str]]:
    """``(kind, key, text)`` per finding; kind ``"same"`` for an equal tensor."""
    for key in sorted(set(ha.tensors) - set(hb.tensors)):
        yield "only in A", key, key
    for key in sorted(set(hb.tensors) - set(ha.tensors)):
        yield "only in B", key, key
    both = sorted(set(ha.tensors) & set(hb.tensors))
    for batch in batches(ha, both):  # one load per batch and side: linear in the tensor count
        yield from _diff_batch(ha, hb, batch, atol)


def _diff_batch(ha: Any, hb: Any, keys: list[str], atol: float) -> Iterator[tuple[str, str, str]]:
    """:func:`_diff_lines` for ``keys``, held by both sides."""
    same = [k for k in keys if ha.tensors[k].shape == hb.tensors[k].shape]
    values_a, values_b = (read_many(ha, same)[0], read_many(hb, same)[0]) if same else ({}, {})
    for key in keys:
        ta, tb = ha.tensors[key], hb.tensors[key]
        if ta.shape != tb.shape:
            yield "shape", key, f"{key}: {list(ta.shape)} vs {list(tb.shape)}"
            continue
        if ta.dtype.code != tb.dtype.code:
            yield "dtype", key, f"{key}: {ta.dtype.code} vs {tb.dtype.code}"
        found = compare_values(values_a.pop(key), values_b.pop(key), atol)
        if found.differing:
            worst = str(found.worst) if isinstance(found.worst, int) else f"{found.worst:.6g}"  # ints exact
            text = f"{key}: max |a - b| = {worst}, {found.differing} of {found.size} elements differ"
            yield "values", key, text
        elif ta.dtype.code == tb.dtype.code:
            yield "same", key, key


def cmd_diff(args: argparse.Namespace) -> int:
    import nnx_save

    ha, hb = nnx_save.read_header(args.a), nnx_save.read_header(args.b)
    equal: set[str] = set()
    differ: set[str] = set()
    for kind, key, text in _diff_lines(ha, hb, args.atol):
        (equal if kind == "same" else differ).add(key)
        if kind != "same":
            print(f"{kind}: {text}")
    print(
        f"diff: {len(ha.tensors)} tensors in A, {len(hb.tensors)} in B, {len(equal)} equal"
        + (f" (atol {args.atol:g})" if args.atol else "")
        + f", {len(differ)} differ"
    )
    return 1 if differ else 0


# ------------------------------------------------------------------------------- convert


def cmd_convert(args: argparse.Namespace) -> int:
    import nnx_save

    done = nnx_save.convert(args.input, args.output, max_shard_size=args.max_shard_size, key=args.key)
    split = f" in {len(done.files)} file(s) + {done.index.name}" if done.index is not None else ""
    print(f"convert: {args.input} -> {args.output}: {done.tensors} tensors{split}")
    if done.kept:
        print(f"  kept in the metadata (JSON): {', '.join(done.kept)}")
    for line in done.dropped:
        print(f"  dropped: {line}")
    return 0


# ---------------------------------------------------------------------------------- main


class _Parser(argparse.ArgumentParser):
    """argparse, whose refusals end in the one ``nnx-save: error: ...`` line every
    other refusal of the command line ends in (exit status 2)."""

    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        self.exit(2, f"nnx-save: error: {message}\n")


def _parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="nnx-save",
        description="Inspect, verify, compare and convert "
        "safetensors checkpoints (one file, or a HuggingFace multi-file directory).",
    )
    p.add_argument("-v", "--verbose", action="store_true", help="log the nnx_save logger's debug messages to stderr")
    p.add_argument("--version", action="version", version=f"nnx-save {__version__}", help="print the version and exit")
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("inspect", help="list tensors, totals by dtype, parameter count and metadata")
    s.add_argument("source", help="a .safetensors file, a multi-file directory, or a URL")
    s.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    s.add_argument("--filter", metavar="PATTERN", help="only tensors whose name matches this glob ('*attn*')")
    s.set_defaults(run=cmd_inspect)
    s = sub.add_parser("verify", help="validate every header, the index, and every recorded checksum")
    s.add_argument("source")
    s.add_argument("--require-checksums", action="store_true", help="fail when a tensor has no checksum")
    s.set_defaults(run=cmd_verify)
    s = sub.add_parser("diff", help="compare two checkpoints tensor by tensor (max abs difference)")
    s.add_argument("a")
    s.add_argument("b")
    s.add_argument("--atol", type=float, default=0.0, help="values within this absolute difference are equal")
    s.set_defaults(run=cmd_diff)
    s = sub.add_parser(
        "convert",
        help="PyTorch .bin/.pt (one file, or an HF directory of pytorch_model-*.bin), Orbax or safetensors "
        "-> safetensors (one file or sharded)",
    )
    s.add_argument("input")
    s.add_argument("output")
    s.add_argument(
        "--max-shard-size",
        type=parse_size,
        metavar="SIZE",
        help="write a HuggingFace multi-file checkpoint into directory OUTPUT (e.g. 5GB, 500MiB)",
    )
    s.add_argument(
        "--key",
        metavar="NAME",
        help="convert only this sub-dict of a PyTorch checkpoint (a training .pt: --key model; dots go deeper)",
    )
    s.set_defaults(run=cmd_convert)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status."""
    args = _parser().parse_args(argv)  # a refused argument: SystemExit(2) after its error line
    if args.verbose:
        logging.basicConfig(format="%(name)s: %(message)s")
        logging.getLogger("nnx_save").setLevel(logging.DEBUG)
    import nnx_save

    try:
        return args.run(args)
    except BrokenPipeError:  # `nnx-save inspect big | head`
        sys.stderr.close()
        return 0
    except (nnx_save.NnxSaveError, OSError) as e:  # OSError: a path that cannot be read or made
        print(f"nnx-save: error: {e}", file=sys.stderr)
        return 2
