"""``address_space_over(slack)``: cap this process's address space at what it maps now
plus ``slack`` bytes, and restore the previous limit after (the contract tests' memory bound)."""

import contextlib
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
