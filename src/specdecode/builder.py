"""Assemble a SpeculativeGenerator from model names or paths: what the CLI, bench and server share."""

from __future__ import annotations

from collections.abc import Callable

import torch

from specdecode.drafting.base import Drafter
from specdecode.drafting.hybrid import HybridDrafter
from specdecode.drafting.model import ModelDrafter, check_same_tokenizer
from specdecode.drafting.ngram import NgramDrafter
from specdecode.drafting.none import NoDrafter
from specdecode.engine import DEFAULT_MAX_CONTEXT, GammaSchedule, SpeculativeGenerator
from specdecode.errors import InvalidRequestError
from specdecode.models.catalog import DEFAULT_DRAFT
from specdecode.models.linear import parse_quant
from specdecode.models.loading import LoadedModel, load_model, parse_dtype
from specdecode.serving.scheduler import Scheduler

DRAFTERS = ("model", "ngram", "hybrid", "none")
WITH_DRAFT_MODEL = ("model", "hybrid")  # the drafters that load and run a draft model
VERIFY_WIDTH = 9  # rows of every target decode forward in bit-exact mode: gamma <= 8
DEFAULT_GAMMA = 4  # the draft model's fixed length (server, hybrid, bench `model`) and where chosen lengths start
# drafters whose draft length the cost model may choose (hybrid mixes a free lookup and a paid draft in one length)
ADAPTIVE_DRAFTERS = ("model", "ngram")
MAX_GAMMA = VERIFY_WIDTH - 1
DRAFT_MIN_CONFIDENCE = 0.3  # adaptive mode: the draft model stops after a token it gives less than this


def resolve_dtype(dtype: str, rows: int, device: str = "cpu") -> str:
    """'auto': bfloat16 where its matmuls of `rows` rows are clearly faster here (measured once, cached), else
    float32. The dtype is part of the target model: plain and speculative decoding use the same one."""
    if dtype != "auto":
        return dtype
    if torch.device(device).type != "cpu":
        return "bfloat16"
    from specdecode.models.autotune import fastest_dtype

    return fastest_dtype(rows)


def resolve_quant(quant: str, dtype: str, rows: int, device: str = "cpu") -> str:
    """'auto': the fastest kernel on this CPU for matmuls of `rows` rows (measured once and cached)."""
    if quant != "auto":
        return quant
    if torch.device(device).type != "cpu":  # the quantized kernels are torch's CPU ones
        return "none"
    from specdecode.models.autotune import fastest_quant

    return fastest_quant(parse_dtype(dtype), rows)


def load_target(target: str, *, dtype: str = "auto", device: str = "cpu", bit_exact: bool = True,
                quant: str = "none") -> LoadedModel:
    """dtype 'auto': the faster of float32 and bfloat16 here for a step's rows. quant 'auto' picks the fastest
    kernel for a verify step (and so changes the target's outputs: opt-in)."""
    rows = VERIFY_WIDTH if bit_exact else 1  # a bit-exact step always has the verify width
    dtype = resolve_dtype(dtype, rows, device)
    quant = resolve_quant(quant, dtype, VERIFY_WIDTH, device)
    return load_model(target, dtype=dtype, device=device, decode_width=VERIFY_WIDTH if bit_exact else None,
                      quant=quant, head_quant=target_head_quant(quant))


def target_head_quant(quant: str) -> str:
    """A target's lm_head stays wider than its blocks (as llama.cpp's Q4_K_M keeps a 6-bit output layer): dense,
    except beside our row-invariant int4 kernels, where a narrower head in the same kernel reads fewer bytes than
    bf16 and needs no padding rows: int8-amx beside int4-amx, 6-bit w6a8 beside w4a8."""
    return {"int4-amx": "int8-amx", "w4a8": "w6a8"}.get(parse_quant(quant)[0], "none")


def load_draft(draft: str, *, dtype: str = "auto", device: str = "cpu", quant: str = "auto",
               batch: int = 1, vocab: int | None = None) -> LoadedModel:
    """The draft's precision never changes the output, so by default it gets whatever drafts fastest here.
    vocab: draft only among the first `vocab` token ids (a smaller lm_head; still lossless, since verification
    only needs q at the proposed tokens and q = 0 elsewhere)."""
    dtype = resolve_dtype(dtype, batch, device)
    quant = resolve_quant(quant, dtype, batch, device)  # the head too: a third of the 0.5B's weights
    return load_model(draft, dtype=dtype, device=device, quant=quant, head_rows=vocab, head_quant=quant)


def make_drafter(kind: str, target: LoadedModel, draft: LoadedModel | None, *, gamma: int = DEFAULT_GAMMA,
                 adaptive: bool = False, max_context: int | None = None, batch: int = 1) -> Drafter:
    """batch: how many sequences it drafts for at once (the server's --max-batch)."""
    if kind == "none":
        return NoDrafter()
    if kind == "ngram":
        return NgramDrafter()
    if kind in WITH_DRAFT_MODEL:
        if draft is None:
            raise InvalidRequestError(f"drafter {kind!r} needs a draft model (--draft)")
        check_same_tokenizer(target.tokenizer, draft.tokenizer)
        model = ModelDrafter(draft.model, target.model.config.vocab_size,
                             max_context or target.model.config.max_position_embeddings,
                             min_confidence=DRAFT_MIN_CONFIDENCE if adaptive or kind == "hybrid" else 0.0,
                             batch=batch)
        return model if kind == "model" else HybridDrafter(model, gamma)
    raise InvalidRequestError(f"unknown drafter {kind!r}; choose one of {', '.join(DRAFTERS)}")


def build_generator(target: str | LoadedModel, *, draft: str | LoadedModel | None = None, drafter: str = "model",
                    gamma: int | None = None, dtype: str = "auto",
                    device: str = "cpu", bit_exact: bool = True, max_context: int | None = None,
                    quant: str = "none", draft_quant: str = "auto",
                    draft_vocab: int | None = None) -> SpeculativeGenerator:
    """Load what is named (catalog name, HF folder, GGUF file) and wire target, drafter and schedule.

    gamma: a fixed draft length, 1..8 (for hybrid: its model's). By default the model and ngram drafters choose
    each step's length (0 included) from the measured costs and acceptance (engine.CostModel), faster than gamma 4
    in every benchmark that ran both; hybrid drafts 4 model tokens or up to 8 copied ones. quant / draft_quant:
    weight-only quantization of the target / the draft when they are loaded here ("auto": fastest here).
    draft_vocab: the draft proposes only token ids below it (see load_draft)."""
    return _assemble(target, draft, drafter, gamma, dtype, device, bit_exact, max_context, quant, draft_quant,
                     draft_vocab)


def build_scheduler(target: str | LoadedModel, *, max_batch: int = 8, max_queue: int = 64,
                    on_step: Callable[[int], None] | None = None, **generator_args) -> Scheduler:
    """A continuous-batching scheduler for the server: its drafter keeps one row per batch slot. Its batched steps
    draft fixed lengths (gamma, default 4 for the draft model and 8 for lookups): the cost model is per sequence."""
    if max_batch < 1 or max_queue < 0:
        raise InvalidRequestError(f"max_batch must be >= 1 and max_queue >= 0, got {max_batch} and {max_queue}")
    return Scheduler(_assemble(target, **generator_args, batch=max_batch, choose_lengths=False), max_batch, max_queue,
                     on_step)


def check_drafting(drafter: str, gamma: int | None) -> None:
    """The drafting arguments' errors, before anything slow is loaded."""
    if drafter not in DRAFTERS:
        raise InvalidRequestError(f"unknown drafter {drafter!r}; choose one of {', '.join(DRAFTERS)}")
    if gamma is not None and not 1 <= gamma <= MAX_GAMMA:
        raise InvalidRequestError(f"gamma must be in [1, {MAX_GAMMA}], got {gamma}")


def _assemble(target: str | LoadedModel, draft: str | LoadedModel | None = None, drafter: str = "model",
              gamma: int | None = None, dtype: str = "auto", device: str = "cpu",
              bit_exact: bool = True, max_context: int | None = None, quant: str = "none",
              draft_quant: str = "auto", draft_vocab: int | None = None, batch: int = 1,
              choose_lengths: bool = True) -> SpeculativeGenerator:
    check_drafting(drafter, gamma)
    adaptive = choose_lengths and gamma is None and drafter in ADAPTIVE_DRAFTERS
    model_gamma = gamma or DEFAULT_GAMMA
    schedule = GammaSchedule(MAX_GAMMA if drafter == "hybrid" or (drafter == "ngram" and gamma is None)
                             else model_gamma, adaptive, maximum=MAX_GAMMA)
    tgt = target if isinstance(target, LoadedModel) else load_target(target, dtype=dtype, device=device,
                                                                     bit_exact=bit_exact, quant=quant)
    dft = None
    if drafter in WITH_DRAFT_MODEL:
        draft = draft or DEFAULT_DRAFT
        dft = draft if isinstance(draft, LoadedModel) else load_draft(draft, dtype=dtype, device=device,
                                                                      quant=draft_quant, batch=batch, vocab=draft_vocab)
    max_context = max_context or min(tgt.model.config.max_position_embeddings, DEFAULT_MAX_CONTEXT)
    drafting = make_drafter(drafter, tgt, dft, gamma=model_gamma, adaptive=adaptive, max_context=max_context,
                            batch=batch)
    return SpeculativeGenerator(tgt.model, drafting, tgt.tokenizer, schedule, max_context)
