"""Drafters: each module of this package defines one, with a `SPEC` (drafting/base.py) that names it."""

from __future__ import annotations

import functools
import importlib
import pkgutil

from specdecode.drafting.base import DrafterSpec
from specdecode.errors import InvalidRequestError

# prompt lookup where the context repeats, the draft model otherwise: the fastest on Spec-Bench on the CPUs measured
# (docs/benchmarks.md)
DEFAULT_DRAFTER = "hybrid"


@functools.cache
def registry() -> dict[str, DrafterSpec]:
    """Every drafter by name: adding one is adding a module here (each DrafterSpec it defines: a drafter and its
    variants, such as a tree of the same drafter)."""
    specs = {}
    for module in pkgutil.iter_modules(__path__):
        for spec in vars(importlib.import_module(f"{__name__}.{module.name}")).values():
            if isinstance(spec, DrafterSpec):
                specs[spec.name] = spec
    return dict(sorted(specs.items()))


def drafter_spec(name: str) -> DrafterSpec:
    specs = registry()
    if name not in specs:
        raise InvalidRequestError(f"unknown drafter {name!r}; choose one of {', '.join(specs)}")
    return specs[name]
