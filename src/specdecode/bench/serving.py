"""Load test of the HTTP server: concurrent streaming chat clients on Spec-Bench prompts, over loopback.

Each client sends its requests back to back; we report generated tokens/s over the run's wall time,
p50/p95 request latency and time to first token. `serving_bench` starts our own server in-process
for each configuration (drafter x max batch x clients) on models loaded once; `load` alone drives
any OpenAI-compatible server.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from pathlib import Path

import httpx

from specdecode.bench.runtime import cpu_name
from specdecode.bench.spec_bench import DEFAULT_QUESTIONS, load_questions
from specdecode.builder import load_draft, load_target
from specdecode.drafting import drafter_spec
from specdecode.serving.scheduler import build_scheduler
from specdecode.models.catalog import DEFAULT_DRAFT, DEFAULT_TARGET


def _percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))] if xs else float("nan")


async def _one_request(client: httpx.AsyncClient, url: str, model: str, prompt: str, max_tokens: int) -> dict:
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    ttft = None
    usage: dict = {}  # the last chunk's that has them
    spec: dict = {}
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread()).decode()[:300]}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if ttft is None and chunk.get("choices") and chunk["choices"][0]["delta"].get("content"):
                ttft = time.perf_counter() - t0
            usage = chunk.get("usage") or usage
            spec = chunk.get("speculative") or spec
    return {"latency": time.perf_counter() - t0, "ttft": ttft, "tokens": usage.get("completion_tokens", 0),
            "mean_accepted_length": spec.get("mean_accepted_length")}


async def _load(url: str, model: str, prompts: list[list[str]], max_tokens: int, api_key: str | None) -> dict:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with httpx.AsyncClient(headers=headers, timeout=None) as client:
        async def run_client(mine: list[str]) -> list[dict]:
            return [await _one_request(client, url, model, p, max_tokens) for p in mine]

        t0 = time.perf_counter()
        per_client = await asyncio.gather(*(run_client(p) for p in prompts))
        wall = time.perf_counter() - t0
    rows = [r for rs in per_client for r in rs]
    latencies = [r["latency"] for r in rows]
    ttfts = [r["ttft"] for r in rows if r["ttft"] is not None]
    tokens = sum(r["tokens"] for r in rows)
    accepted = [r["mean_accepted_length"] for r in rows if r["mean_accepted_length"]]
    return {"clients": len(prompts), "requests": len(rows), "generated_tokens": tokens, "wall_seconds": round(wall, 2),
            "tokens_per_second": round(tokens / wall, 3), "latency_p50": round(_percentile(latencies, 0.5), 2),
            "latency_p95": round(_percentile(latencies, 0.95), 2), "ttft_p50": round(_percentile(ttfts, 0.5), 2),
            "mean_accepted_length": round(statistics.mean(accepted), 3) if accepted else None}


def load(url: str, model: str, clients: int, requests_per_client: int, max_tokens: int,
         questions: Path = DEFAULT_QUESTIONS, api_key: str | None = None, offset: int = 0) -> dict:
    """Drive a running server with `clients` concurrent streaming clients; each sends its own prompts."""
    qs = load_questions(questions)
    n = clients * requests_per_client
    texts = [qs[(offset + i) % len(qs)].prompt for i in range(n)]
    prompts = [texts[c::clients] for c in range(clients)]
    return asyncio.run(_load(url.rstrip("/"), model, prompts, max_tokens, api_key))


def serving_bench(target: str = DEFAULT_TARGET, draft: str = DEFAULT_DRAFT,
                  drafters: tuple[str, ...] = ("none", "model"), clients: tuple[int, ...] = (1, 4, 8),
                  max_batch: int = 8, requests_per_client: int = 2,
                  max_tokens: int = 64, dtype: str = "auto", max_context: int = 2048,
                  out: Path | None = None, progress=print) -> list[dict]:
    """Every (drafter, clients) pair served batched (`max_batch`) and one sequence per step (max batch 1),
    on models loaded once. The same prompts go to every configuration with the same client count."""
    from specdecode.serving.app import create_app, serve_in_thread

    tgt = load_target(target, dtype=dtype)
    needs_draft = any(drafter_spec(d).needs_draft_model for d in drafters)
    dft = load_draft(draft, dtype=dtype, batch=max_batch) if needs_draft else None
    rows = []
    for drafter in drafters:
        for batch in sorted({max_batch, 1}, reverse=True):
            scheduler = build_scheduler(tgt, draft=dft, drafter=drafter, max_batch=batch, max_context=max_context)
            with serve_in_thread(create_app(scheduler, "bench")) as url:
                load(url, "bench", 1, 1, 8, offset=10_000)  # warm-up, not counted
                for n in clients:
                    if batch == 1 and n == 1 and max_batch != 1:
                        continue  # the same configuration as the batched one
                    t_steps, t_seq = scheduler.steps, scheduler.sequence_steps
                    row = {"drafter": drafter, "max_batch": batch,
                           **load(url, "bench", n, requests_per_client, max_tokens)}
                    steps = scheduler.steps - t_steps
                    row["mean_batch"] = round((scheduler.sequence_steps - t_seq) / steps, 2) if steps else None
                    rows.append(row)
                    progress(json.dumps(row))
            del scheduler
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "serving.json").write_text(json.dumps({"cpu": cpu_name(), "target": target, "draft": draft,
                                                      "dtype": str(tgt.model.dtype).removeprefix("torch."),
                                                      "max_tokens": max_tokens, "rows": rows},
                                                     indent=1))
        (out / "serving.md").write_text(serving_table(rows))
    return rows


def serving_table(rows: list[dict]) -> str:
    """Markdown; the speedup columns compare with plain decoding and with one sequence per step, same clients."""
    def find(drafter, batch, clients):
        return next((r for r in rows if (r["drafter"], r["clients"]) == (drafter, clients)
                     and (r["max_batch"] == batch or (clients == 1 and batch == 1))), None)

    lines = ["| drafter | max batch | clients | requests | tokens/s | p50 latency s | p95 latency s | p50 TTFT s "
             "| mean batch | mean accepted length | vs plain (same batching) | vs one sequence per step |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        plain = find("none", r["max_batch"], r["clients"])
        single = find(r["drafter"], 1, r["clients"])

        def ratio(b: dict | None) -> str:
            return f"{r['tokens_per_second'] / b['tokens_per_second']:.2f}x" if b else "–"

        lines.append(f"| {r['drafter']} | {r['max_batch']} | {r['clients']} | {r['requests']} | "
                     f"{r['tokens_per_second']:.2f} | {r['latency_p50']:.1f} | {r['latency_p95']:.1f} | "
                     f"{r['ttft_p50']:.2f} | {r['mean_batch']} | {r['mean_accepted_length']} | {ratio(plain)} | "
                     f"{ratio(single)} |")
    return "\n".join(lines) + f"\n\nCPU: {cpu_name()}\n"

