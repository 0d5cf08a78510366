"""Drafters: each module of this package defines one, with a `SPEC` (drafting/base.py) that names it."""

from __future__ import annotations

import functools
import importlib
import pkgutil

from specdecode.drafting.base import DrafterSpec
from specdecode.errors import InvalidRequestError


@functools.cache
def registry() -> dict[str, DrafterSpec]:
    """Every drafter by name: adding one is adding a module here."""
    specs = {}
    for module in pkgutil.iter_modules(__path__):
        spec = getattr(importlib.import_module(f"{__name__}.{module.name}"), "SPEC", None)
        if spec is not None:
            specs[spec.name] = spec
    return dict(sorted(specs.items()))


def drafter_spec(name: str) -> DrafterSpec:
    specs = registry()
    if name not in specs:
        raise InvalidRequestError(f"unknown drafter {name!r}; choose one of {', '.join(specs)}")
    return specs[name]
