"""glibc's heap and large temporaries: what a process frees is returned to the OS, not kept as its RSS.

glibc serves an allocation from its heap unless it is above the mmap threshold, and raises that threshold to the
size of the largest block it has freed (up to 32 MiB). Packing a model allocates and frees thousands of temporaries
of a few MiB; on the heap they fragment it, and the process keeps gigabytes it no longer uses. Elsewhere than glibc
these are no-ops.
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache

M_MMAP_THRESHOLD = -3  # mallopt's parameter (malloc.h)
TEMPORARY_THRESHOLD = 128 * 1024  # glibc's initial threshold: blocks above it are mapped and unmapped whole
DECODE_THRESHOLD = 32 * 1024 * 1024  # where glibc's own raising stops: a decode step's tensors reuse heap blocks


@cache
def _libc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL(None)
        libc.mallopt, libc.malloc_trim  # noqa: B018 - glibc has both
        return libc
    except (OSError, AttributeError):
        return None


def release_freed_memory() -> None:
    """Hand the heap's free pages back to the OS (glibc keeps a worker thread's freed arena otherwise)."""
    if (libc := _libc()) is not None:
        libc.malloc_trim(0)


@contextmanager
def temporaries_returned() -> Iterator[None]:
    """Within: every block above 128 KiB is its own mapping, returned to the OS when freed (a model's first load).
    After: the threshold a long-running decode ends at anyway, and the heap's free pages returned."""
    libc = _libc()
    if libc is not None:
        libc.mallopt(M_MMAP_THRESHOLD, TEMPORARY_THRESHOLD)
    try:
        yield
    finally:
        if libc is not None:
            libc.mallopt(M_MMAP_THRESHOLD, DECODE_THRESHOLD)
        release_freed_memory()
