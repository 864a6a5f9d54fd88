"""The one thing pyproject.toml does not declare: the optional native gather of scattered
runs out of a memory map (src/nnx_save/io/_gather.c). Optional: an install without a C
compiler still works, gathering through process_vm_readv (nnx_save/io/_mapped.py)."""

from setuptools import Extension, setup

setup(ext_modules=[Extension("nnx_save.io._gather", ["src/nnx_save/io/_gather.c"], optional=True)])
