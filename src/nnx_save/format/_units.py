"""Byte counts for people: one formatter for messages, the command line and progress bars."""

__all__ = ["human_bytes"]


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
