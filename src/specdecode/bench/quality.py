"""What weight-only quantization costs in quality: greedy agreement with the unquantized target on Spec-Bench
prompts (first divergence), and the mean log-likelihood each model gives the unquantized model's outputs."""

from __future__ import annotations

import statistics

import torch

from specdecode.bench.spec_bench import DEFAULT_QUESTIONS, first_mismatch, load_questions
from specdecode.builder import build_generator, load_target


def mean_log_likelihood(model, prompt: list[int], output: list[int]) -> float:
    """Mean log p(output[i] | prompt, output[:i]) under `model`, teacher-forced in one forward."""
    ids = torch.tensor([prompt + output])
    cache = model.new_cache(1, ids.shape[1] + 16)
    logits = model(ids, torch.tensor([0]), cache)[0, len(prompt) - 1:-1]  # [len(output), V]
    logp = torch.log_softmax(logits.float(), -1)
    return float(logp.gather(1, torch.tensor(output).unsqueeze(1)).mean())


def quant_quality(target: str, quants: list[str], *, dtype: str = "bfloat16", prompts: int = 20,
                  max_new_tokens: int = 64, log=print) -> dict:
    """For each quant: first greedy divergence from the unquantized model per prompt, and mean log-likelihood
    of the unquantized model's greedy outputs (the unquantized model's own figure is the ceiling)."""
    questions = [q.prompt for q in load_questions(DEFAULT_QUESTIONS)][:prompts]
    reference = build_generator(load_target(target, dtype=dtype, bit_exact=False, quant="none"), drafter="none")
    encoded = [reference.encode(q, chat=True) for q in questions]
    outputs = [reference.generate(ids, max_new_tokens=max_new_tokens).token_ids for ids in encoded]
    rows = {"none": {"first_divergence": [None] * len(outputs),
                     "mean_log_likelihood": statistics.mean(mean_log_likelihood(reference.target, p, o)
                                                            for p, o in zip(encoded, outputs) if o)}}
    log(f"none: mean log-likelihood {rows['none']['mean_log_likelihood']:.4f}")
    for quant in quants:
        gen = build_generator(load_target(target, dtype=dtype, bit_exact=False, quant=quant), drafter="none")
        diverge = [first_mismatch(o, gen.generate(ids, max_new_tokens=max_new_tokens).token_ids)
                   for ids, o in zip(encoded, outputs)]
        ll = statistics.mean(mean_log_likelihood(gen.target, p, o) for p, o in zip(encoded, outputs) if o)
        rows[quant] = {"first_divergence": diverge, "identical": sum(d is None for d in diverge),
                       "mean_log_likelihood": ll}
        log(f"{quant}: {rows[quant]['identical']} of {len(outputs)} identical; first divergences {diverge}; "
            f"mean log-likelihood {ll:.4f}")
    return {"target": target, "dtype": dtype, "prompts": len(outputs), "max_new_tokens": max_new_tokens,
            "output_lengths": [len(o) for o in outputs], "quants": rows}
