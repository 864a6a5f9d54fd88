"""The ``nnx-save`` command line: ``inspect``, ``verify``, ``diff`` and ``convert``.

Built on the public API (:func:`read_header`, :func:`load_file`) plus the
streaming writer for ``convert``. Tensor data is read one tensor at a time (a
:class:`Header` narrowed to one tensor is a source ``load_file`` reads alone), so
memory stays bounded by the largest tensor whatever the checkpoint's size.

Exit status: 0 when all holds, 1 when ``verify`` finds a problem or ``diff`` a
difference, 2 on a usage error or a checkpoint that cannot be read.
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
from typing import Any

import numpy as np

from ..errors import OptionError
from ..format import _units
from ..format._units import human_bytes

__all__ = ["main"]

_CHECKSUMS = "nnx_save.checksums"


class CLIError(Exception):
    """A usage or input problem: printed as ``nnx-save: error: ...``, exit status 2."""


def parse_size(text: str) -> int:
    """``"5GB"`` -> 5_000_000_000, ``"200MiB"`` -> 209_715_200, ``"1000"`` -> 1000."""
    try:
        return _units.parse_size(text, "--max-shard-size")
    except OptionError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size (examples: 5GB, 200MiB, 1000000)") from None


# ------------------------------------------------------------------- one tensor at a time


def _one(header: Any, key: str, *, verify: bool = False) -> tuple[np.ndarray, Any]:
    """Read one tensor (and the load report) of ``header`` as a host numpy array."""
    import nnx_save

    info = header.tensors[key]
    held = {p.info.file for p in header.pieces_of(key)}  # a pod tensor's pieces are in its shard files
    narrowed = dataclasses.replace(
        header, tensors={key: info}, files=tuple(fh for fh in header.files if fh.file in held)
    )
    tree, report = nnx_save.load_file(narrowed, verify=verify, progress=False, return_report=True)
    return tree[key], report


def _display_file(header: Any, file: str) -> str:
    return os.path.basename(file) if header.kind != "file" else file


# ------------------------------------------------------------------------------- inspect


def _rows(header: Any, pattern: str | None) -> list[dict[str, Any]]:
    rows = []
    for name, t in header.tensors.items():
        if pattern and not fnmatch.fnmatchcase(name, pattern):
            continue
        rows.append(
            {
                "name": name,
                "dtype": t.dtype.code,
                "shape": list(t.shape),
                "numel": t.numel,
                "nbytes": t.nbytes,
                "file": _display_file(header, t.file),
                "begin": t.begin,
                "end": t.end,
            }
        )
    return rows


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
                v = f"<{len(json.loads(v))} xxh3_64 digests>"
            except (ValueError, TypeError):
                v = "<malformed>"
        out[k] = v if len(v) <= 100 else v[:97] + "..."
    return out


def _table(rows: Sequence[dict[str, Any]]) -> list[str]:
    cells = [["name", "dtype", "shape", "size", "file", "bytes"]]
    for r in rows:
        cells.append(
            [
                r["name"],
                r["dtype"],
                "[" + ", ".join(map(str, r["shape"])) + "]",
                human_bytes(r["nbytes"]),
                r["file"],
                f"[{r['begin']}, {r['end']})",
            ]
        )
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
    for key in fh.tensors:
        try:
            _, report = _one(header, key, verify=True)
        except nnx_save.ChecksumError as e:
            problems.append(str(e))
            if e.key is None:  # the checksum record itself is unreadable: nothing more to check here
                return verified, unverified
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
    if args.require_checksums and total_unverified:
        problems.append(f"{total_unverified} tensors have no checksum (--require-checksums)")
        print(f"FAIL {problems[-1]}")
    print(
        f"verify: {args.source}: {len(header.files)} file(s), {len(header.tensors)} tensors, "
        f"{total_verified} verified, {total_unverified} without a checksum, {len(problems)} problem(s)"
    )
    return 1 if problems else 0


# ---------------------------------------------------------------------------------- diff


def max_abs_diff(a: np.ndarray, b: np.ndarray, chunk: int = 1 << 22) -> float:
    """``max |a - b|`` in float64, NaN where only one side is NaN; equal values
    (including equal infinities and NaN against NaN) count as 0. Works in chunks so
    the float64 temporaries stay small."""
    fa, fb = a.reshape(-1), b.reshape(-1)
    worst = 0.0
    for i in range(0, fa.size, chunk):
        x = fa[i : i + chunk].astype(np.float64)
        y = fb[i : i + chunk].astype(np.float64)
        same = (x == y) | (np.isnan(x) & np.isnan(y))
        with np.errstate(invalid="ignore"):
            d = np.where(same, 0.0, np.abs(x - y))
        if np.isnan(d).any():
            return math.nan
        if d.size:
            worst = max(worst, float(d.max()))
    return worst


def _diff_lines(ha: Any, hb: Any, atol: float) -> Iterator[tuple[str, str]]:
    for key in sorted(set(ha.tensors) - set(hb.tensors)):
        yield "only in A", key
    for key in sorted(set(hb.tensors) - set(ha.tensors)):
        yield "only in B", key
    for key in sorted(set(ha.tensors) & set(hb.tensors)):
        ta, tb = ha.tensors[key], hb.tensors[key]
        if ta.shape != tb.shape:
            yield "shape", f"{key}: {list(ta.shape)} vs {list(tb.shape)}"
            continue
        if ta.dtype.code != tb.dtype.code:
            yield "dtype", f"{key}: {ta.dtype.code} vs {tb.dtype.code}"
        a, _ = _one(ha, key)
        b, _ = _one(hb, key)
        worst = max_abs_diff(a, b)
        del a, b
        if not worst <= atol:  # NaN counts as a difference
            yield "values", f"{key}: max |a - b| = {worst:.6g}"
        else:
            yield "same", key


def cmd_diff(args: argparse.Namespace) -> int:
    import nnx_save

    ha, hb = nnx_save.read_header(args.a), nnx_save.read_header(args.b)
    counts: dict[str, int] = {}
    for kind, text in _diff_lines(ha, hb, args.atol):
        counts[kind] = counts.get(kind, 0) + 1
        if kind != "same":
            print(f"{kind}: {text}")
    differences = sum(n for k, n in counts.items() if k != "same")
    print(
        f"diff: {len(ha.tensors)} tensors in A, {len(hb.tensors)} in B, {counts.get('same', 0)} equal"
        + (f" (atol {args.atol:g})" if args.atol else "")
        + f", {differences} difference(s)"
    )
    return 1 if differences else 0


# ------------------------------------------------------------------------------- convert


def cmd_convert(args: argparse.Namespace) -> int:
    import nnx_save

    done = nnx_save.convert(args.input, args.output, max_shard_size=args.max_shard_size, key=args.key)
    split = f" in {len(done.files)} file(s) + {done.index.name}" if done.index is not None else ""
    print(f"convert: {args.input} -> {args.output}: {done.tensors} tensors{split}")
    return 0


# ---------------------------------------------------------------------------------- main


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="nnx-save",
        description="Inspect, verify, compare and convert "
        "safetensors checkpoints (one file, or a HuggingFace multi-file directory).",
    )
    p.add_argument("-v", "--verbose", action="store_true", help="log the nnx_save logger's debug messages to stderr")
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
    s = sub.add_parser("convert", help="PyTorch .bin/.pt, Orbax or safetensors -> safetensors (one file or sharded)")
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
    args = _parser().parse_args(argv)
    if args.verbose:
        logging.basicConfig(format="%(name)s: %(message)s")
        logging.getLogger("nnx_save").setLevel(logging.DEBUG)
    import nnx_save

    try:
        return args.run(args)
    except BrokenPipeError:  # `nnx-save inspect big | head`
        sys.stderr.close()
        return 0
    except (CLIError, nnx_save.NnxSaveError, OSError) as e:  # OSError: a path that cannot be read or made
        print(f"nnx-save: error: {e}", file=sys.stderr)
        return 2
