"""Limits for the contract tests: ``address_space_over(slack)`` caps this process's address
space at what it maps now plus ``slack`` bytes and restores the previous limit after (their
memory bound); ``descriptor_limit(monkeypatch, soft)`` makes the process read a smaller soft
descriptor limit."""

import contextlib
import os
import resource
from collections.abc import Iterator


@contextlib.contextmanager
def address_space_over(slack: int) -> Iterator[None]:
    with open("/proc/self/status") as f:
        vm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (vm + slack, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def descriptor_limit(monkeypatch, soft: int) -> None:
    """Make this process read ``soft`` as its soft ``RLIMIT_NOFILE`` for the rest of a test
    (only the reading, ``os.sysconf("SC_OPEN_MAX")`` as nnx_save reads it: no descriptor is
    refused), so the pool of pinned descriptors, a quarter of it (docs/reliability.md), is
    ``soft // 4``."""
    real = os.sysconf

    def sysconf(name: str | int) -> int:
        return soft if name in ("SC_OPEN_MAX", os.sysconf_names["SC_OPEN_MAX"]) else real(name)

    monkeypatch.setattr(os, "sysconf", sysconf)
