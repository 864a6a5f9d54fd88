"""A strict refusal's rename suggestion, followed as written, loads every tensor into
its own place, or no suggestion is made: generated over nestings and renames of a
model (modules renamed in every layer, projections wrapped by LoRA, the model nested
under a prefix or un-nested, extra and dropped tensors as bait), and the two real
models the suggestion once scrambled (``self_attn`` -> ``attn`` over two layers, and
``nnx.LoRA(base_module=...)`` around the attention projections)."""

from __future__ import annotations

import re
import warnings

import jax.numpy as jnp
import numpy as np
import pytest
from _nnx_helpers import poison
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st

import nnx_save
from nnx_save.load._renames import pair_by_structure, suggest_renames
from nnx_save.porting import Rules, rename

POISON = -7.0


class Node(nnx.Module):
    """A module built from a nested dict of shapes (``nnx.List`` where keys are 0..n-1)."""

    def __init__(self, tree: dict) -> None:
        for name, sub in tree.items():
            setattr(self, name, _build(sub))


def _build(sub):
    if isinstance(sub, tuple):
        return nnx.Param(jnp.full(sub, POISON, jnp.float32))
    if sorted(sub) == [str(i) for i in range(len(sub))]:
        return nnx.List([_build(sub[str(i)]) for i in range(len(sub))])
    return Node(sub)


def model_of(shapes: dict[str, tuple[int, ...]]) -> Node:
    """A poisoned model whose state paths are the keys of ``shapes``."""
    tree: dict = {}
    for path, shape in shapes.items():
        *parents, leaf = path.split("/")
        node = tree
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = shape
    return Node(tree)


def values(model: Node) -> dict[str, np.ndarray]:
    return {"/".join(map(str, p)): np.asarray(v.get_value()) for p, v in nnx.to_flat_state(nnx.state(model))}


def source_of(keys: dict[str, tuple[int, ...]]) -> dict[str, np.ndarray]:
    """Each key a distinct tensor (its own offset, increasing values): a misplaced or
    transposed tensor cannot pass for the right one."""
    return {
        k: (np.arange(int(np.prod(s)), dtype=np.float32) + 1000 * (i + 1)).reshape(s)
        for i, (k, s) in enumerate(sorted(keys.items()))
    }


def refusal(model: Node, source, **kw) -> nnx_save.LoadReport:
    with pytest.raises(nnx_save.LoadError) as caught:
        nnx_save.load_model(model, source, strict=True, **kw)
    return caught.value.report


def rules_of(suggestions: list[str]) -> Rules:
    """The suggestion as a user would paste it."""
    return Rules(*(eval(s, {"rename": rename}) for s in suggestions))


def placed(model: Node, source: dict[str, np.ndarray], truth: dict[str, str | None]) -> set[str]:
    """The model paths holding their own source tensor; fails on any path holding
    anything but that tensor or the poison."""
    got = values(model)
    assert set(got) == set(truth)
    right = set()
    for path, value in got.items():
        own = truth[path]
        if own is not None and value.shape == source[own].shape and np.array_equal(value, source[own]):
            right.add(path)
        else:
            assert np.all(value == POISON), f"{path} holds a tensor not its own (its own: {own})"
    return right


# ---------------------------------------------------------------- generated models


FRESH = ["attn", "mixer", "blk", "wq", "proj2", "ffn"]


@st.composite
def ported(draw):
    """(file keys with shapes, model paths -> their own file key or None, whether the
    change is one a structural pairing must recover in full)."""
    layers = draw(st.integers(1, 3))
    attn = draw(st.sampled_from(["self_attn", "attention"]))
    projs = draw(st.lists(st.sampled_from(["q", "k", "v", "o"]), min_size=1, max_size=4, unique=True))
    bias = draw(st.booleans())
    keys: dict[str, tuple[int, ...]] = {"embed/embedding": (6, 4), "norm/scale": (4,)}
    for i in range(layers):
        for p in projs:
            keys[f"layers/{i}/{attn}/{p}/kernel"] = (4, 4)
            if bias:
                keys[f"layers/{i}/{attn}/{p}/bias"] = (4,)
        keys[f"layers/{i}/mlp/up/kernel"] = (4, 8)
        keys[f"layers/{i}/mlp/down/kernel"] = (8, 4)
    model = {k: k for k in keys}
    shapes = dict(keys)
    ops = draw(
        st.lists(
            st.sampled_from(["rename", "rename_proj", "lora", "nest", "unnest", "bait", "drop"]), min_size=1, max_size=3
        )
    )
    complete = len(ops) == 1 and ops[0] not in ("bait", "drop")
    for op in ops:
        model, shapes, keys = _apply(draw, op, model, shapes, keys, attn, projs)
    return keys, {p: model[p] for p in model}, shapes, complete


def _apply(draw, op, model, shapes, keys, attn, projs):
    """One change of the model (``model``: path -> own key, ``shapes``: path -> shape)."""
    if op in ("rename", "rename_proj"):
        old = attn if op == "rename" else draw(st.sampled_from(projs))
        new = draw(st.sampled_from(FRESH))
        move = {p: "/".join(new if c == old else c for c in p.split("/")) for p in model}
    elif op == "lora":
        proj = draw(st.sampled_from(projs))
        move = {p: re.sub(rf"/{proj}/kernel$", f"/{proj}/base_module/kernel", p) for p in model}
    elif op == "nest":
        move = {p: f"model/{p}" for p in model}
    elif op == "unnest":  # the file nested, the model not
        keys = {f"model/{k}": s for k, s in keys.items()}
        return {p: f"model/{k}" if k else None for p, k in model.items()}, shapes, keys
    elif op == "drop":  # the file has one more layer than the model
        last = max(int(m[1]) for k in keys if (m := re.search(r"layers/(\d+)/", k)))
        kept = {p: k for p, k in model.items() if k is None or f"layers/{last}/" not in k}
        return kept, {p: shapes[p] for p in kept}, keys
    else:  # bait: a model path and a file key no pairing may join (transposed shapes)
        keys = {**keys, "old_head/kernel": (5, 3)}
        return {**model, "head/kernel": None}, {**shapes, "head/kernel": (3, 5)}, keys
    model2 = {move[p]: k for p, k in model.items()}
    shapes2 = {move[p]: s for p, s in shapes.items()}
    if op == "lora":  # the adapter's own factors: missing, with no source
        for p in [p for p in model2 if p.endswith("/base_module/kernel") and p not in model.values()]:
            base = p[: -len("/base_module/kernel")]
            for name, shape in (("lora_a", (4, 2)), ("lora_b", (2, 4))):
                model2.setdefault(f"{base}/{name}", None)
                shapes2.setdefault(f"{base}/{name}", shape)
    return model2, shapes2, keys


@settings(max_examples=120)
@given(ported())
def test_a_followed_suggestion_puts_every_tensor_in_its_place(case):
    keys, truth, shapes, complete = case
    if all(truth[p] == p for p in truth) and set(keys) == set(truth):
        return  # nothing changed: nothing to refuse
    source = source_of(keys)
    report = refusal(model_of(shapes), source)
    before = _load(shapes, source, None, truth)
    suggestions = report.suggested_renames
    if suggestions:
        after = _load(shapes, source, rules_of(suggestions), truth)
        assert before <= after, f"{sorted(before - after)} loaded before the suggestion, not after"
        assert after > before, f"the suggestion {suggestions} placed nothing"
    if complete:  # one structural change: every tensor with a source is recovered
        assert suggestions, f"no suggestion for {sorted(report.missing)[:4]} / {sorted(report.unexpected)[:4]}"
        model = model_of(shapes)
        nnx_save.load_model(model, source, strict=True, rules=rules_of(suggestions), allow_missing=[r".*/lora_[ab]"])
        assert placed(model, source, truth) == {p for p, k in truth.items() if k is not None}


def _load(shapes, source, rules, truth) -> set[str]:
    model = model_of(shapes)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            nnx_save.load_model(model, source, rules=rules)
        except nnx_save.LoadError as e:
            assert "nothing to load" in str(e)
    return placed(model, source, truth)


# ---------------------------------------------------------------- real models


class Attention(nnx.Module):
    def __init__(self, rngs: nnx.Rngs, lora: bool = False) -> None:
        for name in ("q", "k", "v"):
            linear = nnx.Linear(4, 4, use_bias=False, rngs=rngs)
            setattr(self, name, nnx.LoRA(4, 2, 4, base_module=linear, rngs=rngs) if lora else linear)


class Layer(nnx.Module):
    def __init__(self, rngs: nnx.Rngs, name: str, lora: bool) -> None:
        setattr(self, name, Attention(rngs, lora))


class Stack(nnx.Module):
    def __init__(self, seed: int, name: str = "self_attn", lora: bool = False) -> None:
        rngs = nnx.Rngs(seed)
        self.layers = nnx.List([Layer(rngs, name, lora) for _ in range(2)])


@pytest.mark.parametrize(
    ("target", "expected", "allow"),
    [
        ({"name": "attn"}, r'rename(r"layers/(\d+)/self_attn/(.*)", r"layers/\1/attn/\2")', ()),
        ({"lora": True}, r'rename(r"(.*[/.])kernel", r"\1base_module/kernel")', [r".*/lora_[ab]"]),
    ],
    ids=["self_attn-to-attn", "lora-base-module"],
)
def test_the_real_cases_load_every_kernel_in_place(tmp_path, target, expected, allow):
    path = tmp_path / "m.safetensors"
    nnx_save.save_model(Stack(0), path)
    saved = nnx_save.load_file(path)
    report = refusal(Stack(1, **target), path)
    assert report.suggested_renames == [expected]
    assert expected in str(nnx_save.LoadError("", report)) or expected in report.remedy()
    model = poison(Stack(1, **target))
    nnx_save.load_model(model, path, strict=True, rules=rules_of(report.suggested_renames), allow_missing=allow)
    got = values(model)
    for key, value in saved.items():
        place = key.replace("self_attn", "attn") if "name" in target else key.replace("/kernel", "/base_module/kernel")
        assert np.array_equal(got[place], np.asarray(value)), f"{key} did not land at {place}"


# ---------------------------------------------------------------- the pairing itself


def test_ties_pair_nothing():
    """Two projections renamed at once to names sharing nothing: a tie, no pair."""
    missing = {f"l/{i}/a/{n}/w": (4, 4) for i in range(2) for n in ("query", "key")}
    unexpected = {f"l/{i}/a/{n}/w": (4, 4) for i in range(2) for n in ("q", "k")}
    assert pair_by_structure(missing, unexpected) == {}
    assert suggest_renames(missing, unexpected) == []


def test_index_for_index():
    """Layer indices never cross: a model with layers 1 and 2 pairs no file layer 0."""
    missing = {"blocks/1/w": (2,), "blocks/2/w": (2,)}
    unexpected = {"layers/0/w": (2,), "layers/1/w": (2,)}
    assert pair_by_structure(missing, unexpected) == {"layers/1/w": "blocks/1/w"}


def test_a_rule_never_takes_a_key_that_loads():
    """``(.*/)kernel`` would also take ``head/kernel``, which loads as it is: refused for
    the narrower rules."""
    missing = {f"l/{i}/q/base_module/kernel": (4, 4) for i in range(2)}
    unexpected = {f"l/{i}/q/kernel": (4, 4) for i in range(2)}
    got = suggest_renames(missing, unexpected, keys=["head/kernel"], paths=["head/kernel"])
    assert got == [r'rename(r"l/(\d+)/q/(.*)", r"l/\1/q/base_module/\2")']
