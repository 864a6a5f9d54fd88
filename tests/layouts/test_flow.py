"""How a save and a load walk the package: ``benchmarks/flow.py`` traces
``save_model(model, dir, max_shard_size=...)`` and ``load_model(builder, dir)`` of a
10-tensor model at run time and counts changes of module among nnx_save's frames.

Counted over every thread (a save writes files on helper threads, a load reads on
reader threads). A save enters each package it needs once on the way down and returns
once; the bounds below hold the walk to that shape, with a little room for the reader
threads' scheduling (a run now and then counts one more change), so a change that makes
the flow bounce between packages again fails here (docs/design.md, "One walk through
the packages").
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import flow

import nnx_save


def test_the_tracer_counts_changes_of_module_not_calls():
    """parse_size -> to_key -> parse_size: three modules entered in turn, two changes
    (to_key's own helper ``segment`` is in its module); format/ is none of the four
    packages the walk names."""
    from nnx_save.format import _paths, _units

    got = flow.trace(lambda: (_units.parse_size("1KB"), _paths.to_key(("a",)), _units.parse_size("2KB")))
    assert (got["calls"], got["module_changes"], got["walk"], got["package_switches"]) == (4, 2, [], 0)
    assert (got["caller_module_changes"], got["caller_package_switches"]) == (2, 0)


def test_a_save_and_a_load_walk_the_package_with_few_returns(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", nnx_save.SingleDeviceWarning)
        result = flow.measure(tmp_path)
    save, load = result["save"], result["load"]
    assert save["module_changes"] <= 210 and save["package_switches"] <= 39, save
    assert load["module_changes"] <= 251 and load["package_switches"] <= 35, load
    assert save["walk"][0] == "save" and "layouts" in save["walk"] and load["walk"][:2] == ["load", "layouts"]
