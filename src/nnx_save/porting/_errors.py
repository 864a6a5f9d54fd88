"""The porting errors, for the porting modules: defined, and documented, in the public
:mod:`nnx_save.errors`; ``nnx_save.porting`` re-exports them under the same names.
"""

from __future__ import annotations

from ..errors import NotInvertibleError as NotInvertibleError
from ..errors import RuleConflictError as RuleConflictError
from ..errors import RuleError as RuleError
from ..errors import RuleShapeError as RuleShapeError

__all__ = [
    "NotInvertibleError",
    "RuleConflictError",
    "RuleError",
    "RuleShapeError",
]
