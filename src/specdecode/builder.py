"""Assemble a SpeculativeGenerator from model names or paths: what the CLI, bench and server share."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch

from specdecode.draft_lengths import MAX_GAMMA, GammaSchedule
from specdecode.drafting import DEFAULT_DRAFTER, drafter_spec
from specdecode.drafting.base import Drafter, DraftingSetup
from specdecode.engine import DEFAULT_MAX_CONTEXT, SpeculativeGenerator
from specdecode.errors import InvalidRequestError, ModelLoadError
from specdecode.models.catalog import DEFAULT_DRAFT, resolve
from specdecode.models.gguf_loader import read_gguf_config
from specdecode.models.hf_loader import read_hf_config
from specdecode.models.linear import kernel, kernels
from specdecode.models.loading import LoadedModel, is_gguf, load_model, parse_dtype
from specdecode.paths import cache_dir

if TYPE_CHECKING:
    from specdecode.heads.format import Head

VERIFY_WIDTH = MAX_GAMMA + 1  # rows of every target decode forward in bit-exact mode
# a draft model's default vocabulary: its first ids (Qwen2.5's 65536 first hold 98% of Spec-Bench's answer tokens),
# a lm_head 2.3x smaller than the 0.5B's 151936 rows, which were a third of its weights (docs/draft-lengths.md)
DRAFT_VOCAB = 65536


def resolve_dtype(dtype: str, rows: int, device: str = "cpu") -> str:
    """'auto': by this CPU's class (autotune.dtype_choice: bfloat16 with AMX, float32 without AVX-512, measured on
    the others). The dtype is part of the target model: plain and speculative decoding use the same one."""
    if dtype != "auto":
        return dtype
    if torch.device(device).type != "cpu":
        return "bfloat16"
    from specdecode.models.autotune import dtype_choice

    return dtype_choice(rows)[0]


def native_kind(dtype: str) -> str | None:
    """The kernel that runs a GGUF file's blocks as stored on this CPU with `dtype` activations (`Linear.native`),
    if one does: on AMX tiles (bfloat16), else with int8 activations (AVX2 and AVX-512 CPUs)."""
    ranked = sorted(kernels().items(), key=lambda item: item[0] != "gguf")  # AMX first, whatever imported first
    return next((kind for kind, cls in ranked if cls.native and dtype in cls.native_dtypes and cls.available()), None)


def resolve_quant(quant: str, dtype: str, rows: int, device: str = "cpu", source: str | None = None,
                  fallback: str = "none", draft: bool = False) -> str:
    """'file': the precision of the file `source`: a GGUF file's own blocks on this CPU's native kernel for `dtype`;
    where there is none (safetensors, no native kernel for this CPU) `fallback`. 'auto': the fastest kernel on this
    CPU for matmuls of `rows` rows (measured once and cached); for a draft, `draft_quant_choice`."""
    if quant not in ("file", "auto"):
        return quant
    native = native_kind(dtype) if torch.device(device).type == "cpu" and source and is_gguf(source) else None
    if quant == "file":
        quant = native or fallback
    if quant != "auto":
        return quant
    if torch.device(device).type != "cpu":  # the quantized kernels are torch's CPU ones
        return "none"
    from specdecode.models.autotune import draft_quant_choice, fastest_quant

    dt = parse_dtype(dtype)
    return draft_quant_choice(dt, rows, native)[0] if draft else fastest_quant(dt, rows)


def load_target(target: str, *, dtype: str = "auto", device: str = "cpu", bit_exact: bool = True,
                quant: str = "file") -> LoadedModel:
    """dtype 'auto': chosen for this CPU (resolve_dtype). quant 'file': the model as its file defines it (a GGUF
    file's blocks as stored where a native kernel runs here, else dense in `dtype`); other kernels re-quantize,
    and so change the target's outputs: opt-in ('auto' picks the fastest for a verify step)."""
    if quant == "gguf-q4":
        raise InvalidRequestError("--quant gguf-q4 is for drafts (--draft-quant): it re-quantizes a file's blocks; "
                                  "a target's --quant file runs them as stored")
    rows = VERIFY_WIDTH if bit_exact else 1  # a bit-exact step always has the verify width
    dtype = resolve_dtype(dtype, rows, device)
    quant = resolve_quant(quant, dtype, VERIFY_WIDTH, device, target)
    return load_model(target, dtype=dtype, device=device, decode_width=VERIFY_WIDTH if bit_exact else None,
                      quant=quant, head_quant=target_head_quant(quant))


def target_head_quant(quant: str) -> str:
    """A target's lm_head stays wider than its blocks (as llama.cpp's Q4_K_M keeps a 6-bit output layer): what the
    blocks' kernel declares (`Linear.head`): dense, except beside our row-invariant int4 kernels, where a narrower
    head in the same kernel reads fewer bytes than bf16 and needs no padding rows."""
    return kernel(quant).head


def load_draft(draft: str, *, dtype: str = "auto", device: str = "cpu", quant: str = "auto",
               batch: int = 1, vocab: int | None = None) -> LoadedModel:
    """The draft's precision never changes the output, so by default ('auto') it gets whatever kernel drafts fastest
    here ('file' keeps its file's own blocks, as the target's default does).
    vocab: draft only among the first `vocab` token ids (a smaller lm_head; still lossless, since verification
    only needs q at the proposed tokens and q = 0 elsewhere); default DRAFT_VOCAB where the draft has more."""
    if vocab is None:
        vocab = _default_vocab(draft)
    dtype = resolve_dtype(dtype, batch, device)
    # the head too (a third of the 0.5B); a draft's kernel never changes the output
    quant = resolve_quant(quant, dtype, batch, device, draft, fallback="auto", draft=True)
    return load_model(draft, dtype=dtype, device=device, quant=quant, head_rows=vocab, head_quant=quant)


def _default_vocab(draft: str) -> int | None:
    """DRAFT_VOCAB where the draft's vocabulary is larger, else None (all of it; also where its config does not
    read: loading it then says why)."""
    try:
        path = resolve(draft)
        cfg = read_gguf_config(path) if is_gguf(path) else read_hf_config(path)
    except (OSError, ValueError, ModelLoadError):
        return None
    return DRAFT_VOCAB if cfg.vocab_size > DRAFT_VOCAB else None


def default_head_dir(target: LoadedModel, kind: str) -> Path:
    """Where `specdecode train-draft` puts a head by default, and where drafting looks for one without --draft."""
    return cache_dir() / "heads" / f"{target.source.name.removesuffix('.gguf')}-{kind}"


def load_drafting_head(kind: str, target: LoadedModel, path: str | Path | None) -> Head:
    """The trained head at `path` (default: `default_head_dir`), checked against the target and the drafter."""
    from specdecode.heads.format import load_head

    where = Path(path) if path is not None else default_head_dir(target, kind)
    if path is None and not where.is_dir():
        raise InvalidRequestError(f"drafter {kind!r} needs a trained head: --draft DIR, or train this target's "
                                  f"default one with `specdecode train-draft --kind {kind}` and the same --target "
                                  f"(writes {where})")
    head = load_head(where, target.model)
    found = "eagle3" if type(head).__name__ == "Eagle3Head" else "medusa"
    if found != kind:
        raise InvalidRequestError(f"{where} holds a {found} head; drafter {kind!r} needs a {kind} head")
    return head


def make_drafter(kind: str, target: LoadedModel, draft: LoadedModel | None, *, gamma: int | None = None,
                 chooses_lengths: bool = False, max_context: int | None = None, batch: int = 1,
                 head: Head | None = None) -> Drafter:
    """The drafter named `kind` (drafting.registry()); gamma: its length (default: the drafter's); batch: how many
    sequences it drafts for at once (the server's --max-batch); head: the trained head of a head drafter."""
    spec = drafter_spec(kind)
    if spec.needs_draft_model and draft is None:
        raise InvalidRequestError(f"drafter {kind!r} needs a draft model (--draft)")
    return spec.build(DraftingSetup(target, draft, head, gamma or spec.gamma, chooses_lengths,
                                    max_context or target.model.config.max_position_embeddings, batch))


def check_drafting(drafter: str, gamma: int | None) -> None:
    """The drafting arguments' errors, before anything slow is loaded."""
    drafter_spec(drafter)
    if gamma is not None and not 1 <= gamma <= MAX_GAMMA:
        raise InvalidRequestError(f"gamma must be in [1, {MAX_GAMMA}], got {gamma}")


def build_generator(target: str | LoadedModel, *, draft: str | LoadedModel | None = None,
                    drafter: str = DEFAULT_DRAFTER, gamma: int | None = None, dtype: str = "auto",
                    device: str = "cpu", bit_exact: bool = True, max_context: int | None = None,
                    quant: str = "file", draft_quant: str = "auto",
                    draft_vocab: int | None = None, batch: int = 1) -> SpeculativeGenerator:
    """Load what is named (catalog name, HF folder, GGUF file) and wire target, drafter and draft lengths.

    gamma: a fixed draft length, 1..8. By default the drafters that can (drafting.registry(): model, ngram) choose
    each step's length (0 included) from the measured costs and acceptance (draft_lengths.CostModel); the others
    draft their own default length. quant / draft_quant: the target's / the draft's kernels when they are loaded
    here ("file": the file's own precision, "auto": fastest here; see load_target and load_draft). draft_vocab: the
    draft proposes only token ids below it (see load_draft). batch: sequences drafted for at once
    (serving.scheduler.build_scheduler)."""
    check_drafting(drafter, gamma)
    spec = drafter_spec(drafter)
    chooses_lengths = gamma is None and spec.chooses_lengths
    schedule = GammaSchedule(gamma or spec.gamma, chooses_lengths, maximum=MAX_GAMMA)
    tgt = target if isinstance(target, LoadedModel) else load_target(target, dtype=dtype, device=device,
                                                                     bit_exact=bit_exact, quant=quant)
    dft, head = None, None
    if spec.head_kind is not None:  # --draft names the head's folder (a loaded draft model is another drafter's)
        head = load_drafting_head(spec.head_kind, tgt, None if isinstance(draft, LoadedModel) else draft)
    elif spec.needs_draft_model:
        draft = draft or DEFAULT_DRAFT
        dft = draft if isinstance(draft, LoadedModel) else load_draft(draft, dtype=dtype, device=device,
                                                                      quant=draft_quant, batch=batch, vocab=draft_vocab)
    max_context = max_context or min(tgt.model.config.max_position_embeddings, DEFAULT_MAX_CONTEXT)
    drafting = make_drafter(drafter, tgt, dft, gamma=schedule.initial, chooses_lengths=chooses_lengths,
                            max_context=max_context, batch=batch, head=head)
    return SpeculativeGenerator(tgt.model, drafting, tgt.tokenizer, schedule, max_context)
