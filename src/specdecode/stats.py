"""Per-request statistics, counted in one place (the engine) and derived here."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    new_tokens: int = 0
    target_forward_passes: int = 0  # decode steps; prefill is counted apart
    drafts: int = 0  # steps whose drafter proposed at least one token
    drafted_tokens: int = 0  # a tree's nodes all count
    accepted_tokens: int = 0
    tree_drafts: int = 0  # drafts that branched (token trees)
    drafted_by_position: list[int] = field(default_factory=list)
    accepted_by_position: list[int] = field(default_factory=list)
    prefill_seconds: float = 0.0
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    total_seconds: float = 0.0

    def record_step(self, drafted: int, accepted: int, depth: int | None = None) -> None:
        """One step: its draft's tokens (a tree's nodes), how many it kept and how deep it reached (a chain: as deep
        as it is long). The by-position counts are by depth."""
        depth = drafted if depth is None else depth
        self.target_forward_passes += 1
        self.drafts += drafted > 0
        self.tree_drafts += depth < drafted
        self.drafted_tokens += drafted
        self.accepted_tokens += accepted
        grow = depth - len(self.drafted_by_position)
        if grow > 0:
            self.drafted_by_position += [0] * grow
            self.accepted_by_position += [0] * grow
        for i in range(depth):
            self.drafted_by_position[i] += 1
            self.accepted_by_position[i] += i < accepted

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens per target forward pass (accepted + 1 per step), as Spec-Bench and vLLM count it."""
        return self.new_tokens / self.target_forward_passes if self.target_forward_passes else 0.0

    @property
    def nodes_per_draft(self) -> float:
        """Tokens per draft that drafted (a tree's nodes)."""
        return self.drafted_tokens / self.drafts if self.drafts else 0.0

    @property
    def accepted_per_draft(self) -> float:
        """Accepted tokens per draft that drafted: the accepted depth of a tree."""
        return self.accepted_tokens / self.drafts if self.drafts else 0.0

    @property
    def acceptance_by_position(self) -> list[float]:
        return [a / d if d else 0.0 for a, d in zip(self.accepted_by_position, self.drafted_by_position)]

    @property
    def tokens_per_second(self) -> float:
        """End to end, prefill included."""
        return self.new_tokens / self.total_seconds if self.total_seconds else 0.0

    @property
    def decode_tokens_per_second(self) -> float:
        decode = self.total_seconds - self.prefill_seconds
        return self.new_tokens / decode if decode > 0 else 0.0

    def to_dict(self) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens,
            "new_tokens": self.new_tokens,
            "target_forward_passes": self.target_forward_passes,
            "drafts": self.drafts,
            "drafted_tokens": self.drafted_tokens,
            "accepted_tokens": self.accepted_tokens,
            "tree_drafts": self.tree_drafts,
            "nodes_per_draft": round(self.nodes_per_draft, 3),
            "accepted_per_draft": round(self.accepted_per_draft, 3),
            "acceptance_rate": round(self.acceptance_rate, 4),
            "mean_accepted_length": round(self.mean_accepted_length, 4),
            "acceptance_by_position": [round(x, 4) for x in self.acceptance_by_position],
            "drafted_by_position": self.drafted_by_position,
            "accepted_by_position": self.accepted_by_position,
            "prefill_seconds": round(self.prefill_seconds, 4),
            "draft_seconds": round(self.draft_seconds, 4),
            "verify_seconds": round(self.verify_seconds, 4),
            "total_seconds": round(self.total_seconds, 4),
            "tokens_per_second": round(self.tokens_per_second, 3),
            "decode_tokens_per_second": round(self.decode_tokens_per_second, 3),
        }
