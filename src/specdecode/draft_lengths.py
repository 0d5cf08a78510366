"""How many tokens to draft each step: a fixed length, a grow/shrink rule, or the length a cost model expects to be
fastest. Which length runs never changes the output, only the speed (docs/draft-lengths.md)."""

from __future__ import annotations

from dataclasses import dataclass, field

from specdecode.errors import InvalidRequestError

MAX_GAMMA = 8  # draft tokens per step at most: a bit-exact target's decode forwards are 9 rows wide


@dataclass
class Timings:
    """Seconds measured as decoding goes, exponential moving averages: a target forward per width (rows per sequence)
    and a drafted token. Shared by every sequence a generator or a server decodes."""

    decay: float = 0.9
    forward: dict[int, float] = field(default_factory=dict)  # width -> seconds
    draft: float | None = None  # seconds per drafted token

    def observe(self, width: int, forward_s: float, draft_s_per_token: float | None) -> None:
        d = self.decay
        old = self.forward.get(width)
        self.forward[width] = forward_s if old is None else d * old + (1 - d) * forward_s
        if draft_s_per_token is not None:
            self.draft = draft_s_per_token if self.draft is None else d * self.draft + (1 - d) * draft_s_per_token

    def forward_seconds(self, width: int) -> float:
        """Measured, else linear in the width through the two nearest measured widths (at least 2 measured)."""
        if width in self.forward:
            return self.forward[width]
        near = sorted(self.forward, key=lambda w: (abs(w - width), w))[:2]
        (w0, t0), (w1, t1) = sorted((w, self.forward[w]) for w in near)
        return max(t0 + (t1 - t0) * (width - w0) / (w1 - w0), min(self.forward.values()) / 4)


@dataclass
class CostModel:
    """What speculation costs and yields: the shared `timings`, and how often a drafted token is accepted.

    `best_gamma` takes the gamma that maximises expected tokens per second under these numbers (Leviathan et al.
    2023, section 3.4: (1 - a^(g+1)) / (1 - a) tokens for g * c_draft + c_forward(g + 1) seconds), 0 included: a
    plain step, where drafting does not pay (a slow draft, a verify cost that grows fast with k, low acceptance).
    After PROBE_AFTER plain steps in a row it drafts one token in two steps to see whether acceptance and the draft's
    cost have changed; each probe that ends in plain steps again doubles the wait (up to MAX_PROBE_AFTER), since a
    probe's first step makes the draft model read the whole context it missed. The draft's cost is only taken from a
    drafting step that follows one: the first also reads the prompt or the tokens since the last draft into the
    draft model's cache. It decides nothing before WARM_UP tokens have been drafted (the grow/shrink rule runs
    meanwhile), and it averages the acceptance more slowly than the timings, except on probes: a few drafts say
    little about the acceptance, and plain steps bring no news to undo a dip, so a dip must not switch drafting off
    where it pays, while a probe is the only news there is.
    """

    PROBE_AFTER = 16
    WARM_UP = 16  # drafted tokens before the acceptance is trusted: two drafts of 4 are too few to give up drafting
    MAX_PROBE_AFTER = 1024
    timings: Timings = field(default_factory=Timings)
    decay: float = 0.9  # of the acceptance counts on probe steps
    acceptance_decay: float = 0.97  # of the acceptance counts on other drafting steps
    accepted: float = 1.0  # decayed counts of accepted and rejected drafted tokens: a 50% prior
    rejected: float = 1.0
    plain_steps: int = 0  # plain steps in a row chosen by `best_gamma`
    probing: int = 0  # probe steps still to run
    probe_after: int = PROBE_AFTER  # plain steps in a row before the next probe
    drafted_last: bool = False  # whether the sequence's previous step drafted
    drafted_tokens: int = 0  # over this model's life
    probe_step: bool = False  # whether `best_gamma` last chose a probe

    def start_sequence(self) -> None:
        self.drafted_last = False

    def observe(self, width: int, forward_s: float, drafted: int, accepted: int, draft_s: float | None,
                depth: int | None = None) -> None:
        """One step: its forward's width and seconds, the tokens drafted (a tree's nodes) and accepted, the seconds
        drafting took (None: the step's drafting also did other work, such as another sequence catching up on its
        context), and how deep the draft went (a chain: its length): a draft kept to its depth had no rejection."""
        depth = drafted if depth is None else depth
        steady = drafted and self.drafted_last  # and draft_s is not None: no catching up on the context
        self.timings.observe(width, forward_s, draft_s / drafted if steady and draft_s is not None else None)
        self.drafted_tokens += drafted
        if drafted:
            d = self.decay if self.probe_step else self.acceptance_decay
            self.accepted = d * self.accepted + accepted
            self.rejected = d * self.rejected + (accepted < depth)
        self.drafted_last = drafted > 0

    def best_gamma(self, maximum: int) -> int | None:
        """The draft length worth running now, or None until a draft and two forward widths have been timed and
        WARM_UP tokens drafted."""
        t = self.timings
        if t.draft is None or len(t.forward) < 2 or self.drafted_tokens < self.WARM_UP:
            return None
        a = self.accepted / (self.accepted + self.rejected)
        draft = t.draft

        def tokens_per_second(g: int) -> float:
            tokens = (1 - a ** (g + 1)) / (1 - a) if a < 1 else g + 1.0
            return tokens / (g * draft + t.forward_seconds(g + 1))

        best = max(range(maximum + 1), key=tokens_per_second)
        self.plain_steps = self.plain_steps + 1 if best == 0 else 0
        if best:
            self.probe_after = self.PROBE_AFTER
        if self.plain_steps > self.probe_after:
            self.plain_steps, self.probing = 0, 2
            self.probe_after = min(2 * self.probe_after, self.MAX_PROBE_AFTER)
        self.probe_step = bool(self.probing and best == 0)
        if self.probe_step:
            self.probing -= 1
            return 1
        self.probing = 0
        return best


@dataclass(frozen=True)
class GammaSchedule:
    """Draft length: fixed, or adaptive: chosen by a CostModel once it has measured enough (except for seeded samples
    with rejection coupling, whose draws depend on it), before that (and for those samples) grown after a fully
    accepted draft and shrunk after an early rejection."""

    initial: int = 4
    adaptive: bool = False
    minimum: int = 1
    maximum: int = MAX_GAMMA

    def __post_init__(self) -> None:
        if self.initial <= 0 or self.minimum <= 0:
            raise InvalidRequestError(f"gamma must be >= 1, got {self.initial}")
        if not self.minimum <= self.initial <= self.maximum:
            raise InvalidRequestError(f"gamma {self.initial} is outside [{self.minimum}, {self.maximum}]")

    def next(self, gamma: int, drafted: int, accepted: int) -> int:
        if not self.adaptive or drafted == 0:
            return gamma
        if accepted == drafted:
            return min(gamma + 1, self.maximum)
        if accepted < drafted // 2:
            return max(gamma - 1, self.minimum)
        return gamma


class DraftLengths:
    """One sequence's draft length: `next` before drafting, `observe` after the step."""

    def __init__(self, schedule: GammaSchedule, costs: CostModel, by_costs: bool) -> None:
        """by_costs: let `costs` choose (False for draws that depend on the lengths: timings differ between runs)."""
        self.schedule, self.costs, self.gamma = schedule, costs, schedule.initial
        self.by_costs = by_costs and schedule.adaptive

    def next(self, room: int) -> int:
        """Tokens to draft now, at most `room` (the bonus token always comes from the target)."""
        chosen = self.costs.best_gamma(self.schedule.maximum) if self.by_costs else None
        self.gamma = self.gamma if chosen is None else chosen
        return min(self.gamma, room)

    def observe(self, width: int, forward_s: float, drafted: int, accepted: int, draft_s: float | None,
                depth: int | None = None) -> None:
        self.costs.observe(width, forward_s, drafted, accepted, draft_s, depth)
        self.gamma = self.schedule.next(self.gamma, drafted if depth is None else depth, accepted)
