"""Names vulture (`make test`, tests/test_house.py) reports as unused that are used.

Each line marks a name as used; the comment says who uses it. Dead code is removed, not
listed here, except the block at the end: code in modules under rework elsewhere, to go
with that rework.
"""

# ruff: noqa: B018
_ = object()

# PEP 562 module hooks, called by the import system: lazy public names (nnx_save, io/_storage).
_.__getattr__
_.__dir__
# The context-manager protocol's __exit__(exc_type, exc, tb): the interpreter passes them.
_.exc
# The safetensors-compatible handle nnx_save.safe_open returns (bridges/_lazy): public API.
_.get_shape
_.get_dtype
_.file_metadata
_.get_slice
_.get_tensors
# The training store's public methods (checkpoint/_store, its protocol in checkpoint/_types).
_.should_save
_.damaged_steps
_.best_step
_.delete
# KeyMapping.apply: public (nnx_save.porting), every target's value in memory (docs/porting.md).
_.apply
# The table tests/test_config.py checks docs/configuration.md against.
_.VARIABLES
# The settings the C scanner of CPython's _json reads off its context (format/_header._Plain).
_.object_hook
_.object_pairs_hook
_.parse_float
_.parse_int
_.parse_constant
