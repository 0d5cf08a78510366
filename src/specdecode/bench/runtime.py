"""Runtime benchmark: load time, peak RSS and ms per forward of k new tokens after a context, beside transformers.

Each (model, dtype, engine) runs in a fresh process so peak RSS and load time are its own.
"""

from __future__ import annotations

import multiprocessing as mp
import resource
import statistics
import time

import torch

from specdecode.cpu import cpu_info


def cpu_name() -> str:
    return cpu_info()[0]


def _median_ms(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def _ours(model: str, dtype: str, context: int, ks: list[int], repeats: int, width: int | None,
          quant: str = "none", as_draft: bool = False, draft_vocab: int | None = None) -> dict:
    """as_draft: load the model as `builder.load_draft` does (its lm_head as narrow as its blocks, only its first
    draft_vocab rows if given), else as a target (its lm_head wider, see `builder.target_head_quant`)."""
    from specdecode.builder import load_draft, resolve_quant, target_head_quant
    from specdecode.models.loading import load_model

    if as_draft and is_head(model):
        return _head(model, context, ks, repeats)
    # 'file' and 'auto' name a kernel by the file and this CPU, as generate's loading does
    quant = resolve_quant(quant, dtype, width or 1, "cpu", model, fallback="auto" if as_draft else "none",
                          draft=as_draft)
    t = time.perf_counter()
    if as_draft:
        m = load_draft(model, dtype=dtype, quant=quant, vocab=draft_vocab).model
    else:
        m = load_model(model, dtype=dtype, decode_width=width, with_tokenizer=False, quant=quant,
                       head_quant=target_head_quant(quant)).model
    load_s = time.perf_counter() - t
    ids = torch.randint(0, m.config.vocab_size, (1, context + max(ks)))
    cache = m.new_cache(1, context + max(ks))
    m(ids[:, :context], torch.tensor([0]), cache, num_logits=0)
    start = torch.tensor([context])
    ms = {k: _median_ms(lambda k=k: m(ids[:, context:context + k], start, cache), repeats) for k in ks}
    return {"load_s": load_s, "ms": ms, "head_rows": m.lm_head.out_features, "kernel": quant}


def is_head(path: str) -> bool:
    """Whether `path` is a drafting head's folder (heads/format.py), not a model."""
    from pathlib import Path

    config = Path(path) / "config.json"
    keys = ('"speculators_model_type"', '"specdecode_head"')
    return config.is_file() and (Path(path) / "model.safetensors").is_file() and \
        any(key in config.read_text() for key in keys)


def _head(path: str, context: int, ks: list[int], repeats: int) -> dict:
    """ms to draft k tokens with a trained head after `context` pairs, as its drafter does: an EAGLE-3 head's k
    layer steps, each with its logits put on the target's vocabulary and its argmax; Medusa's heads all at once
    (k <= its head count; one call)."""
    from specdecode.drafting.base import DraftRequest, choose_among
    from specdecode.heads.eagle3 import Eagle3Head
    from specdecode.heads.format import load_head
    from specdecode.verification.sampling import SamplingParams

    t = time.perf_counter()
    head = load_head(path, None)
    D, V, ids = head.cfg.hidden_size, head.cfg.target_vocab, head.draft_ids

    greedy = DraftRequest(0, [], 1, SamplingParams(), torch.Generator())

    def on_target_vocab(logits: torch.Tensor) -> int:  # as the drafters choose a greedy token, with its confidence
        return choose_among(ids, logits, V, greedy, 0)[0]

    if isinstance(head, Eagle3Head):
        rt = head.runtime()
        load_s = time.perf_counter() - t
        cache = rt.new_cache(1, context + max(ks) + 1)
        rt.step(torch.randn(context, D), torch.randn(context, D), 0, cache, 0)
        x = torch.randn(1, D)

        def draft(k: int) -> None:
            o = x
            for i in range(k):
                on_target_vocab(rt.logits(o)[0])
                o = rt.step(o, x, context + i, cache, 0)
    else:
        medusa = head.runtime()
        load_s = time.perf_counter() - t

        def draft(k: int) -> None:
            logits = medusa.logits(torch.randn(D))
            for i in range(min(k, len(logits))):
                on_target_vocab(logits[i])
    ms = {k: _median_ms(lambda k=k: draft(k), repeats) for k in ks}
    return {"load_s": load_s, "ms": ms, "head_rows": len(ids)}


def _hf(model: str, dtype: str, context: int, ks: list[int], repeats: int) -> dict:
    from transformers import DynamicCache

    from specdecode.bench.peers import hf_model

    t = time.perf_counter()
    hf = hf_model(model, dtype)
    load_s = time.perf_counter() - t
    ids = torch.randint(0, hf.config.vocab_size, (1, context + max(ks)))
    cache = DynamicCache(config=hf.config)
    with torch.inference_mode():
        hf(ids[:, :context], past_key_values=cache, use_cache=True)

        def step(k: int) -> None:
            hf(ids[:, context:context + k], past_key_values=cache, use_cache=True)
            cache.crop(-k)  # back to the context

        ms = {k: _median_ms(lambda k=k: step(k), repeats) for k in ks}
    return {"load_s": load_s, "ms": ms}


def _llama_cpp(model: str, context: int, ks: list[int], repeats: int) -> dict:
    """llama.cpp (llama-cpp-python) on the same GGUF: k tokens evaluated after `context`, then dropped again."""
    from llama_cpp import Llama

    from specdecode.models.catalog import resolve

    t = time.perf_counter()
    llm = Llama(model_path=str(resolve(model)), n_ctx=context + max(ks) + 16, n_threads=torch.get_num_threads(),
                n_batch=512, verbose=False)
    load_s = time.perf_counter() - t
    ids = torch.randint(1000, 20000, (context + max(ks),)).tolist()
    llm.eval(ids[:context])

    def step(k: int) -> None:
        llm.eval(ids[context:context + k])
        llm.n_tokens = context
        llm._ctx.kv_cache_seq_rm(-1, context, -1)  # back to the context

    return {"load_s": load_s, "ms": {k: _median_ms(lambda k=k: step(k), repeats) for k in ks}}


def _child(queue, engine: str, model: str, dtype: str, context: int, ks: list[int], repeats: int,
           width: int | None, quant: str, as_draft: bool, draft_vocab: int | None) -> None:
    if engine == "transformers":
        result = _hf(model, dtype, context, ks, repeats)
    elif engine == "llama.cpp":
        result = _llama_cpp(model, context, ks, repeats)
    else:
        result = _ours(model, dtype, context, ks, repeats, width, quant, as_draft, draft_vocab)
    result["peak_rss_gb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    queue.put(result)


def measure(engine: str, model: str, dtype: str, context: int, ks: list[int], repeats: int,
            width: int | None, quant: str = "none", as_draft: bool = False, draft_vocab: int | None = None) -> dict:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_child, args=(q, engine, model, dtype, context, ks, repeats, width, quant, as_draft,
                                              draft_vocab))
    p.start()
    p.join()
    if p.exitcode != 0 or q.empty():
        raise RuntimeError(f"{engine} measurement of {model} ({dtype}, {quant}) failed (exit code {p.exitcode})")
    return q.get()


def run_runtime_bench(models: list[str], dtypes: list[str], *, context: int = 500, ks: list[int] | None = None,
                      repeats: int = 20, with_hf: bool = True, bit_exact: bool = True, quants: list[str] | None = None,
                      with_llama_cpp: bool = False, draft: str | None = None, draft_vocab: int | None = None
                      ) -> list[dict]:
    """ms per forward of k tokens after `context`, per model, dtype and quant, ours beside the peers.
    draft: also that model loaded as a draft (the head it drafts with; `draft_vocab` rows of it), per dtype and quant,
    and its one-token step as a fraction of each target's (the cost of a drafted token against a target step)."""
    from specdecode.builder import VERIFY_WIDTH
    from specdecode.models.catalog import resolve

    ks = ks or [1, 2, 4, 8, 16]
    print(f"CPU: {cpu_name()} | torch {torch.__version__} ({torch.backends.cpu.get_cpu_capability()}), "
          f"{torch.get_num_threads()} threads | context {context} | median of {repeats}")
    engines: list[tuple[str, int | None]] = [("specdecode bit-exact", VERIFY_WIDTH)] if bit_exact else []
    engines.append(("specdecode", None))
    runs = [(name, width, dtype, quant) for dtype in dtypes for quant in quants or ["file"] for name, width in engines]
    if with_hf:
        runs += [("transformers", None, dtype, "none") for dtype in dtypes]
    if with_llama_cpp:
        runs.append(("llama.cpp", None, "gguf", "gguf"))  # models that are not GGUF files are skipped below
    header = "| model | dtype | quant | engine | load s | peak RSS GB | " + " | ".join(f"k={k} ms" for k in ks) + \
             " | " + " | ".join(f"ms({k})/ms(1)" for k in ks if k > 1) + " |"
    print(header)
    print("|" + "---|" * (header.count("|") - 1))
    rows = []

    def report(model: str, dtype: str, quant: str, engine: str, r: dict, label: str | None = None, **extra) -> None:
        ms = r["ms"]
        shown = quant if r.get("kernel", quant) == quant else f"{quant} ({r['kernel']})"  # file -> file (gguf-int8)
        print(f"| {model} | {dtype} | {shown} | {label or engine} | {r['load_s']:.1f} | {r['peak_rss_gb']:.2f} | "
              + " | ".join(f"{ms[k]:.1f}" for k in ks) + " | "
              + " | ".join(f"{ms[k] / ms[1]:.2f}" for k in ks if k > 1) + " |", flush=True)
        rows.append({"model": model, "dtype": dtype, "quant": quant, "engine": engine, **extra, **r})

    for model in models:
        for name, width, dtype, quant in runs:
            engine = name if name in ("transformers", "llama.cpp") else "ours"
            if engine == "llama.cpp" and not resolve(model).is_file():
                print(f"| {model} | – | – | llama.cpp | skipped: llama.cpp needs a GGUF file |", flush=True)
                continue
            report(model, dtype, quant, name, measure(engine, model, dtype, context, ks, repeats, width, quant))
    if draft is None:
        return rows
    targets = [t for t in rows if t["engine"] in dict(engines)]  # ours, not the peers
    for dtype in dtypes:
        for quant in quants or ["file"]:
            d = measure("ours", draft, dtype, context, ks, repeats, None, quant, True, draft_vocab)
            what = f"head, vocab {d['head_rows']}" if is_head(draft) else f"vocab {d['head_rows']}"
            report(draft, dtype, quant, "specdecode draft", d, f"specdecode draft ({what})", draft_vocab=draft_vocab)
            for t in (t for t in targets if (t["dtype"], t["quant"]) == (dtype, quant) and 1 in ks):
                t["draft_step_fraction"] = d["ms"][1] / t["ms"][1]
                print(f"draft one-token step / {t['model']} ({t['engine']}, {dtype}, {quant}): "
                      f"{d['ms'][1]:.1f} / {t['ms'][1]:.1f} ms = {t['draft_step_fraction']:.2f}")
    return rows
