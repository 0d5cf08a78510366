"""What a benchmark method is and what one run of it yields: shared by our engine's methods and the peers'."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol


@dataclass
class RunOutput:
    token_ids: list[int]
    seconds: float  # prefill + decode, end to end
    target_forward_passes: int  # target forwards that yielded tokens (a prefill that yields none is not one)
    drafted_by_position: list[int] = field(default_factory=list)
    accepted_by_position: list[int] = field(default_factory=list)
    draft_seconds: float = 0.0


class Method(Protocol):
    name: str

    def run(self, prompt_ids: list[int], max_new_tokens: int, temperature: float, seed: int,
            eos_ids: list[int]) -> RunOutput: ...


class PeerUnavailable(Exception):
    """A peer's optional package is not installed (or cannot run these weights): the bench skips it."""
