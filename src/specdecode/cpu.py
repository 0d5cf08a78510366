"""What this machine's CPU is: its model name and feature flags (Linux /proc/cpuinfo; empty elsewhere)."""

from __future__ import annotations

import platform
from functools import cache
from pathlib import Path


@cache
def cpu_info() -> tuple[str, frozenset[str]]:
    """(model name, flags)."""
    name, flags = "", frozenset[str]()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and not name:
                name = value.strip()
            elif key.strip() == "flags" and not flags:
                flags = frozenset(value.split())
    except OSError:
        pass
    return name or platform.processor() or platform.machine(), flags
