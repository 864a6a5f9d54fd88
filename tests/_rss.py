"""Peak resident memory of this process, for the measuring scripts run in fresh processes
(tests/_stream_rss.py, tests/_cast_rss.py): no dependency beyond /proc."""


def status(field: str) -> int:
    """``field`` of ``/proc/self/status`` (``VmRSS``, ``VmHWM``) in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(field)


def reset_peak() -> int:
    """Reset ``VmHWM`` to the current RSS (``/proc/self/clear_refs``); returns that RSS."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return status("VmRSS")
