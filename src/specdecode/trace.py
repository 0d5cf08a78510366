"""What each step of a request did, token by token: recorded when a request asks for it (`trace=True`), read by the
HTML report (tools/report.py) and `specdecode verify`."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch

from specdecode.drafting.base import Draft
from specdecode.verification.sampling import SamplingParams, processed_probs

KINDS = ("accepted", "corrected", "bonus", "target")


@dataclass(frozen=True)
class TokenTrace:
    """One emitted token. kind: accepted (drafted, kept by the target), corrected (the target's, where it rejected a
    drafted token), bonus (the target's, after a draft it kept whole), target (a step that drafted nothing)."""

    token: int
    kind: str
    step: int
    p: float  # the target's probability of the token (its sampling distribution; greedy: at temperature 1)
    q: float | None = None  # accepted: the draft's probability of it (None: the draft's argmax or a deterministic one)
    rejected: int | None = None  # corrected: the drafted token the target replaced
    rejected_p: float | None = None  # the target's probability of that drafted token
    rejected_q: float | None = None  # the draft's probability of it (None as for q)


@dataclass
class StepTrace:
    drafted: int  # tokens drafted (a tree's nodes)
    depth: int  # the draft's deepest path
    accepted: int
    draft_seconds: float = 0.0  # the batch's drafting and verify forward, which this step waited for
    verify_seconds: float = 0.0


@dataclass
class Trace:
    steps: list[StepTrace] = field(default_factory=list)
    tokens: list[TokenTrace] = field(default_factory=list)

    def record(self, logits: torch.Tensor, draft: Draft, kept: list[int], nxt: int, emitted: int,
               params: SamplingParams) -> None:
        """One step: the target's logits [1 + g, V] after [last, nodes...], the draft, the nodes kept, the token
        that followed them and how many of kept + [nxt] were emitted (fewer at a stop)."""
        step = len(self.steps)
        self.steps.append(StepTrace(len(draft.tokens), max(draft.depths(), default=0), len(kept)))
        p = processed_probs(logits, params) if not params.greedy else torch.softmax(logits.float(), -1)  # [1 + g, V]
        parent = draft.parent_of
        for i in kept[:emitted]:
            tok = draft.tokens[i]
            q = None if draft.probs is None else float(draft.probs[i, tok])
            self.tokens.append(TokenTrace(tok, "accepted", step, float(p[1 + parent[i], tok]), q))
        if emitted <= len(kept):
            return
        last = kept[-1] if kept else -1
        rejected = next((i for i, par in enumerate(parent) if par == last), None)  # the first drafted child
        kind = "target" if not draft.tokens else "bonus" if rejected is None else "corrected"
        row = p[1 + last]
        if rejected is None:
            self.tokens.append(TokenTrace(nxt, kind, step, float(row[nxt])))
            return
        r = draft.tokens[rejected]
        self.tokens.append(TokenTrace(nxt, kind, step, float(row[nxt]), rejected=r, rejected_p=float(row[r]),
                                      rejected_q=None if draft.probs is None else float(draft.probs[rejected, r])))

    def timed(self, draft_seconds: float, verify_seconds: float) -> None:
        """The last step's timings."""
        self.steps[-1].draft_seconds, self.steps[-1].verify_seconds = draft_seconds, verify_seconds

    def to_dict(self) -> dict:
        return {"steps": [asdict(s) for s in self.steps], "tokens": [asdict(t) for t in self.tokens]}
