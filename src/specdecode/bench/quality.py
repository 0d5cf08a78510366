"""What weight-only quantization costs in quality: greedy agreement with the unquantized target on Spec-Bench
prompts (first divergence), and the mean log-likelihood each model gives the unquantized model's outputs.

The reference is the target dequantized to `--dtype` (`--quant none`); a GGUF file's own blocks are `gguf`, and
`llama-cpp` runs the same file in llama.cpp (its own kernels and Q8 activations): the agreement to compare with."""

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


def quant_quality(target: str, quants: list[str], *, dtype: str = "float32", prompts: int = 20,
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
        if quant == "llama-cpp":
            diverge, ll = _llama_cpp(target, encoded, outputs, max_new_tokens, sorted(reference.eos_ids))
        else:  # QUANT or QUANT:DTYPE (e.g. gguf:bfloat16 against a float32 reference)
            kind, _, own_dtype = quant.partition(":")
            own_dtype = own_dtype or ("auto" if kind == "file" else dtype)  # file: the default target, as generate's
            gen = build_generator(load_target(target, dtype=own_dtype, bit_exact=False, quant=kind),
                                  drafter="none")
            diverge = [first_mismatch(o, gen.generate(ids, max_new_tokens=max_new_tokens).token_ids)
                       for ids, o in zip(encoded, outputs)]
            ll = statistics.mean(mean_log_likelihood(gen.target, p, o) for p, o in zip(encoded, outputs) if o)
        rows[quant] = {"first_divergence": diverge, "identical": sum(d is None for d in diverge),
                       "mean_log_likelihood": ll}
        log(f"{quant}: {rows[quant]['identical']} of {len(outputs)} identical; first divergences {diverge}; "
            f"mean log-likelihood {ll:.4f}")
    return {"target": target, "dtype": dtype, "prompts": len(outputs), "max_new_tokens": max_new_tokens,
            "output_lengths": [len(o) for o in outputs], "quants": rows}


def _llama_cpp(target: str, encoded: list[list[int]], outputs: list[list[int]], max_new_tokens: int,
               eos_ids: list[int]) -> tuple[list[int | None], float]:
    """llama.cpp's greedy first divergences from the reference outputs, and its mean log-likelihood of them."""
    import numpy as np
    from llama_cpp import Llama

    from specdecode.bench.peers import LlamaCppMethod

    method = LlamaCppMethod.load("llama-cpp", target, prompt_lookup=False)
    diverge = [first_mismatch(o, method.run(ids, max_new_tokens, 0.0, 0, eos_ids).token_ids)
               for ids, o in zip(encoded, outputs)]
    longest = max(len(p) + len(o) for p, o in zip(encoded, outputs))
    scorer = Llama(model_path=method.llm.model_path, n_ctx=longest + 8, n_batch=512, logits_all=True,
                   n_threads=torch.get_num_threads(), verbose=False)
    lls = []
    for prompt, output in zip(encoded, outputs):
        if not output:
            continue
        scorer.reset()
        scorer.eval(prompt + output)
        logits = torch.from_numpy(np.array(scorer.scores[len(prompt) - 1:len(prompt) + len(output) - 1]))
        logp = torch.log_softmax(logits.float(), -1)
        lls.append(float(logp.gather(1, torch.tensor(output).unsqueeze(1)).mean()))
    return diverge, statistics.mean(lls)
