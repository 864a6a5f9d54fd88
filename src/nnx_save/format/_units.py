"""Byte counts for people: one formatter for messages, the command line and progress
bars, and one parser for the sizes people give (``"5GB"``, ``"200MiB"``, ``1000``)."""

import re

from ..errors import OptionError

__all__ = ["human_bytes", "parse_size"]

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(I?)(B?)\s*$", re.IGNORECASE)
_POWERS = {"": 0, "K": 1, "M": 2, "G": 3, "T": 4}
_MAX = 1 << 62  # bytes: past this a count overflows C and numpy integers
_MAX_TEXT = 64  # characters of a size string ("9" * 400 is no size)


def human_bytes(n: float) -> str:
    """Binary units, one decimal above a KiB.

    Examples:
        >>> human_bytes(1536), human_bytes(512), human_bytes(3 << 30)
        ('1.5 KiB', '512 B', '3.0 GiB')
    """
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def parse_size(value: object, argument: str = "max_shard_size") -> int:
    """A positive byte count from an int or a size string as transformers and the
    HuggingFace hub write them: ``KB`` / ``MB`` / ``GB`` / ``TB`` are powers of 1000,
    ``KiB`` / ``MiB`` / ``GiB`` / ``TiB`` powers of 1024 (case is ignored).

    Raises:
        OptionError: naming ``argument``, for anything else (a bool, a float, zero,
            a negative count, an unknown unit, more than 2**62 bytes).

    Examples:
        >>> parse_size("5GB"), parse_size("200MiB"), parse_size(1000), parse_size("1.5 KB")
        (5000000000, 209715200, 1000, 1500)
    """
    n = None
    if isinstance(value, int) and not isinstance(value, bool):
        n = value
    elif (
        isinstance(value, str)
        and len(value) <= _MAX_TEXT
        and (m := _SIZE.match(value))
        and (m.group(3) == "" or m.group(2))
    ):
        from fractions import Fraction  # with the first size given as text: it imports decimal

        base = 1024 if m.group(3) else 1000
        n = int(Fraction(m.group(1)) * base ** _POWERS[m.group(2).upper()])  # exact: no float rounding or infinity
    if n is None or not 0 < n <= _MAX:
        shown = repr(value) if len(repr(value)) <= 80 else repr(value)[:77] + "..."
        raise OptionError(
            f"{argument}={shown}: expected a positive number of bytes up to 2**62, an int or a size such as "
            "'5GB', '200MiB', '100KB'",
            argument,
        )
    return n
