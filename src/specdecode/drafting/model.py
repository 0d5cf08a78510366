"""A smaller model with the same tokenizer drafts autoregressively from its own KV cache."""

from __future__ import annotations

import torch

from specdecode.drafting.base import Draft, Drafter, DrafterSpec, DraftingSetup, DraftRequest, choose, \
    common_prefix
from specdecode.errors import InvalidRequestError, ModelLoadError
from specdecode.models.decoder import Transformer


MAX_SHARED_FEED = 16  # longer feeds (a new prompt) are prefilled row by row, not padded into the shared forward
# with chosen lengths, drafting stops once the draft gives the chain drafted so far (the product of its tokens'
# probabilities) less than this: its tokens' probabilities are about how often the target keeps them
MIN_PATH = 0.5
# the draft reads at most this many of a new context's last tokens, then every token after them: its prefill of a
# long prompt would otherwise cost more than its drafting saves (docs/draft-lengths.md)
WINDOW = 256


def check_same_tokenizer(target_tokenizer, draft_tokenizer) -> None:
    """A draft must share the target's tokenizer; vocab sizes may differ by padding rows only."""
    if target_tokenizer is None or draft_tokenizer is None:
        return
    t, d = target_tokenizer.get_vocab(), draft_tokenizer.get_vocab()
    if t != d:
        differ = sorted(set(t.items()) ^ set(d.items()))[:3]
        raise ModelLoadError(
            f"the draft's tokenizer differs from the target's ({len(d)} vs {len(t)} tokens; e.g. {differ}); "
            "a draft model must use the same tokenizer as the target")


class ModelDrafter(Drafter):
    """Drafts autoregressively, one cache row per sequence; a batch of sequences drafts in shared forwards
    (one [rows, 1] forward per draft position), so drafting for 8 sequences costs about as much as for one."""

    def __init__(self, model: Transformer, target_vocab: int, max_len: int, min_path: float = 0.0,
                 batch: int = 1, window: int = WINDOW) -> None:
        self.model, self.target_vocab, self.max_len, self.window = model, target_vocab, max_len, window
        self.min_path = min_path  # stop drafting once the draft doubts the chain it drafted
        # reused across requests (stale slots are never visible); slack for the padding of a shared catch-up forward
        self.cache = model.new_cache(batch, max_len + MAX_SHARED_FEED)
        self.cached: list[list[int]] = [[] for _ in range(batch)]  # per row: ids whose keys/values are cached
        self.offset = [0] * batch  # per row: the context's tokens before the draft's window
        self.new = [True] * batch  # per row: no draft yet for its request

    def reset(self, row: int = 0) -> None:
        """A new request on the row: what it shares with the row's cached tokens from the start (a system prompt, an
        earlier turn) is not fed again; a window that started later is dropped (what came before it is unknown).
        Except for a seeded sample with rejection coupling: its output depends on the draft's numbers, which keys
        computed for another request would change in their last bits; it reads its context afresh, so that a seed
        gives the same tokens whatever ran before."""
        self.new[row] = True
        if self.offset[row]:
            self._drop(row)

    def forget(self) -> None:
        for row in range(len(self.cached)):
            self._drop(row)

    def _drop(self, row: int) -> None:
        self.cached[row] = []
        self.offset[row] = 0

    def propose_batch(self, requests: list[DraftRequest]) -> list[Draft]:
        # a plain step (gamma 0) reads nothing: the row's next draft catches up on what it skipped, so a draft
        # model that an adaptive draft length rarely asks costs nothing in between (not even the prompt)
        drafting = [r for r in requests if r.gamma > 0]
        feeds = self._catch_up(drafting)
        tokens: dict[int, list[int]] = {r.row: [] for r in requests}
        qs: dict[int, list[torch.Tensor]] = {r.row: [] for r in requests}
        path = dict.fromkeys(tokens, 1.0)  # the draft's probability of each row's chain
        live = drafting
        while live := [r for r in live if len(self.cached[r.row]) + len(feeds[r.row]) < self.max_len]:
            logits = self._forward([r.row for r in live], [feeds[r.row] for r in live])  # [B', V_target]
            assert logits is not None  # asked for
            still = []
            for r, row_logits in zip(live, logits):
                position = len(r.context) + len(tokens[r.row])
                tok, q, confidence = choose(row_logits, r, position, bool(self.min_path))
                tokens[r.row].append(tok)
                if q is not None:
                    qs[r.row].append(q)
                feeds[r.row] = [tok]
                path[r.row] *= confidence
                if len(tokens[r.row]) < r.gamma and path[r.row] >= self.min_path:
                    still.append(r)
            live = still
        return [Draft(tokens[r.row], torch.stack(qs[r.row]) if qs[r.row] else None)  # None: greedy or Gumbel
                for r in requests]

    def _catch_up(self, requests: list[DraftRequest]) -> dict[int, list[int]]:
        """Each row's tokens not yet in its cache (at least the last context token, at most its window of a new
        context), a long feed (a new prompt) prefilled alone but for its last token: row -> tokens to feed."""
        feeds: dict[int, list[int]] = {}
        for r in requests:
            if self.new[r.row] and r.params.draws_depend_on_draft_lengths:
                self._drop(r.row)
            self.new[r.row] = False
            feed = r.context[self._rollback_to_common_prefix(r.row, r.context):]
            if len(feed) > MAX_SHARED_FEED:
                self._forward([r.row], [feed[:-1]], logits=False)
                feed = feed[-1:]
            feeds[r.row] = feed
        return feeds

    def _forward(self, rows: list[int], feeds: list[list[int]], logits: bool = True) -> torch.Tensor | None:
        """Feed each row its tokens (padded to the longest); the logits after each row's last real token,
        on the target's vocabulary: [len(rows), V_target]."""
        width = max(len(f) for f in feeds)
        tokens = torch.tensor([f + [0] * (width - len(f)) for f in feeds])
        start = torch.tensor([len(self.cached[row]) for row in rows])
        n = width - min(len(f) for f in feeds) + 1 if logits else 0  # the lm_head runs on the last n positions only
        out = self.model(tokens, start, self.cache, rows=torch.tensor(rows), num_logits=n)  # [B', n, V_draft]
        for row, f in zip(rows, feeds):
            self.cached[row].extend(f)
        if not logits:
            return None
        last = out[torch.arange(len(rows)), torch.tensor([len(f) - 1 - (width - n) for f in feeds])]  # [B', V_draft]
        return self._on_target_vocab(last)

    def _on_target_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """[..., V_draft] -> [..., V_target]: q lives on the target's vocabulary (the draft's padding rows dropped,
        the target's extra ids -inf)."""
        v = min(logits.shape[-1], self.target_vocab)
        padded = torch.full((*logits.shape[:-1], self.target_vocab), float("-inf"))
        padded[..., :v] = logits[..., :v]
        return padded

    def _rollback_to_common_prefix(self, row: int, context: list[int]) -> int:
        """Drop cached ids after the first difference from the context's window; returns where in the context the
        tokens to feed start. A new context gets a new window, its last `window` tokens, unless what it shares
        with the cached ones leaves at most `window` to feed (a next turn, or a prompt after one with the same
        system prompt). So does a request whose draft was not asked for more than `window` tokens (plain steps):
        reading its last `window` tokens costs less than catching up."""
        cached = self.cached[row]
        i = common_prefix(cached, context[self.offset[row]:-1])  # always re-feed at least the last token
        if i == 0 or len(context) - self.offset[row] - i > self.window:
            offset = max(0, len(context) - self.window)
            if offset != self.offset[row]:  # the cached keys sit at other positions
                self.offset[row], i = offset, 0
        del cached[i:]  # O(1) for the cache itself: a row's length is len(self.cached[row])
        return self.offset[row] + i


def build(setup: DraftingSetup, min_path: float | None = None, kind: type[ModelDrafter] = ModelDrafter
          ) -> ModelDrafter:
    """The draft model of `setup`, checked against the target's tokenizer (kind: this drafter or one built on it)."""
    if setup.draft is None:
        raise InvalidRequestError("this drafter needs a draft model (--draft)")
    check_same_tokenizer(setup.target.tokenizer, setup.draft.tokenizer)
    if min_path is None:
        min_path = MIN_PATH if setup.chooses_lengths else 0.0
    return kind(setup.draft.model, setup.target.model.config.vocab_size, setup.max_context,
                min_path=min_path, batch=setup.batch)


SPEC = DrafterSpec("model", "a smaller model with the same tokenizer drafts autoregressively", build,
                   needs_draft_model=True, gamma=4, chooses_lengths=True)
