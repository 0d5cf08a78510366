"""Lossless speculative decoding: a drafter proposes, the target verifies in one forward, the output is the target's.

The public API, imported on first use (so that `import specdecode` and the command line's `--help` stay fast):
`build_generator` (one request at a time), `build_scheduler` (the server's batching), `SamplingParams`,
`SpeculativeGenerator`, `GenerationResult` and `__version__`.
"""

from __future__ import annotations

from importlib import import_module
from importlib.metadata import PackageNotFoundError, version
from typing import Any

try:
    __version__ = version("specdecode")
except PackageNotFoundError:  # run from a source tree that was not installed
    __version__ = "0+unknown"

_PUBLIC = {"build_generator": "specdecode.builder", "build_scheduler": "specdecode.serving.scheduler",
           "SamplingParams": "specdecode.verification.sampling", "SpeculativeGenerator": "specdecode.engine",
           "GenerationResult": "specdecode.sequence"}
__all__ = ["__version__", *_PUBLIC]


def __getattr__(name: str) -> Any:
    if name not in _PUBLIC:
        raise AttributeError(f"module 'specdecode' has no attribute {name!r}")
    return getattr(import_module(_PUBLIC[name]), name)
