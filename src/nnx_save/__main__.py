"""``python -m nnx_save``: the same command line as the ``nnx-save`` script."""

from ._cli import main

raise SystemExit(main())
