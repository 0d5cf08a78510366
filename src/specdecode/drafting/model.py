"""A smaller model with the same tokenizer drafts autoregressively from its own KV cache."""

from __future__ import annotations

import torch

from specdecode.drafting.base import Draft
from specdecode.errors import ModelLoadError
from specdecode.models.decoder import Transformer
from specdecode.verification.gumbel import gumbel_noise, noisy_scores
from specdecode.verification.sampling import SamplingParams, processed_probs, sample


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


class ModelDrafter:
    name = "model"

    def __init__(self, model: Transformer, target_vocab: int, max_len: int, min_confidence: float = 0.0) -> None:
        self.model, self.target_vocab, self.max_len = model, target_vocab, max_len
        self.min_confidence = min_confidence  # stop drafting after a token the draft itself doubts
        self.cache = model.new_cache(1, max_len)  # reused across requests: stale slots are never visible
        self.cached: list[int] = []  # ids whose keys/values are in the cache, in order

    def reset(self) -> None:
        self.cached = []

    def propose(self, context: list[int], gamma: int, params: SamplingParams, generator: torch.Generator) -> Draft:
        self._rollback_to_common_prefix(context)
        tokens: list[int] = []
        qs: list[torch.Tensor] = []
        feed = context[len(self.cached):]  # at least the last context token
        for _ in range(gamma):
            if len(self.cached) + len(feed) >= self.max_len:
                break
            logits = self._forward(feed)  # [V_target]
            if params.greedy:
                tok = int(logits.argmax())
                confidence = float(torch.softmax(logits, -1)[tok]) if self.min_confidence else 1.0
            else:
                q = processed_probs(logits, params)
                if params.gumbel:  # the noise the target will use here; verification needs no q
                    noise = gumbel_noise(params.seed, [len(context) + len(tokens)], len(q))
                    tok = int(noisy_scores(q, noise).argmax())
                else:
                    tok = sample(q, generator)
                    qs.append(q)
                confidence = float(q[tok])
            tokens.append(tok)
            feed = [tok]
            if confidence < self.min_confidence:
                break
        return Draft(tokens, torch.stack(qs) if qs else None)  # None: greedy or Gumbel-coupled

    def _forward(self, feed: list[int]) -> torch.Tensor:
        start = torch.tensor([len(self.cached)])
        logits = self.model(torch.tensor([feed]), start, self.cache, num_logits=1)[0, -1]
        self.cached.extend(feed)
        # q lives on the target's vocabulary: drop the draft's padding rows, zero-pad to the target's size
        v = min(logits.shape[-1], self.target_vocab)
        out = torch.full((self.target_vocab,), float("-inf"))
        out[:v] = logits[:v]
        return out

    def _rollback_to_common_prefix(self, context: list[int]) -> None:
        n = min(len(self.cached), len(context) - 1)  # always re-feed at least the last token
        i = 0
        while i < n and self.cached[i] == context[i]:
            i += 1
        del self.cached[i:]  # O(1) for the cache itself: its length is len(self.cached)
