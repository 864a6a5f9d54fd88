"""``python -m nnx_save``: the same command line as the ``nnx-save`` script."""

from .cli._main import main

raise SystemExit(main())
