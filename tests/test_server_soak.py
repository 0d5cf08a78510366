"""Soak: 64 streaming clients against `specdecode serve` (its own process, tiny models) for SPECDECODE_SOAK_SECONDS
(default 300): greedy, sampled, cancelled, malformed and hostile requests mixed. Asserts no unexpected status, greedy
outputs equal to the same request sent alone, and a flat RSS; writes what it measured (statuses by count, RSS, the
latency of an 8-token request alone and beside hostile ones) to $SPECDECODE_SOAK_REPORT or the test's tmp folder."""

from __future__ import annotations

import asyncio
import json
import os
import random
import shutil
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import httpx
import pytest

from .conftest import perturbed, save_tiny, tiny_hf_model, tiny_tokenizer
from .test_server_fuzz import ROLE_CHAT

pytestmark = pytest.mark.slow

KEY = "sk-soak"
AUTH = {"Authorization": f"Bearer {KEY}"}
CLIENTS = 64
PROMPTS = ["hello world", "The cat sat on the mat", "abc def ghi", "Speculative decoding is lossless", "x1 y2 z3",
           "Once upon a time", "numbers 12345", "quick brown fox"]
MALFORMED = ['{"prompt": "abc", ', '{"prompt": "abc", "max_tokens": "4"}', '{"prompt": "abc", "stream": "yes"}',
             '{"prompt": "abc", "temperature": 5}', '{"prompt": "abc\\ud800"}', '{"prompt": [1, 2, 99999]}',
             '{"messages": []}', '{"prompt": "abc", "stop": [""]}', '']
LONG_STOPS = ["".join(chr(ord("a") + (i + j) % 26) for j in range(256)) for i in range(16)]  # 4096 characters


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


async def _stream_text(client: httpx.AsyncClient, url: str, body: dict,
                       cancel_after: int | None = None) -> tuple[int, str]:
    async with client.stream("POST", url + "/v1/completions", json=body | {"stream": True}) as r:
        if r.status_code != 200:
            await r.aread()
            return r.status_code, ""
        text, events = "", 0
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                events += 1
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    return 500, text
                text += chunk["choices"][0]["text"]
                if cancel_after is not None and events >= cancel_after:
                    return 499, text  # hang up mid-stream
        return 200, text


async def _client(n: int, url: str, deadline: float, greedy: dict[tuple[str, int], str], counts: Counter,
                  unexpected: list, mismatches: list) -> None:
    rng = random.Random(n)
    async with httpx.AsyncClient(headers=AUTH, timeout=120) as client:
        while time.time() < deadline:
            kind = rng.choices(["greedy", "sampled", "cancelled", "malformed", "stops", "huge", "chat"],
                               [40, 20, 15, 10, 5, 3, 7])[0]
            prompt, max_tokens = rng.choice(PROMPTS), rng.choice([8, 24, 40])
            try:
                if kind == "greedy":
                    status, text = await _stream_text(client, url, {"prompt": prompt, "max_tokens": max_tokens,
                                                                    "temperature": 0})
                    if status == 200 and text != greedy[prompt, max_tokens]:
                        mismatches.append((prompt, max_tokens, text))
                    expected = 200
                elif kind == "sampled":
                    status, _ = await _stream_text(client, url, {"prompt": prompt, "max_tokens": max_tokens,
                                                                 "temperature": 0.8, "top_p": 0.9,
                                                                 "seed": rng.randrange(2**31)})
                    expected = 200
                elif kind == "cancelled":
                    status, _ = await _stream_text(client, url, {"prompt": prompt, "max_tokens": 200,
                                                                 "temperature": 0}, cancel_after=rng.randint(1, 3))
                    expected = 499
                elif kind == "malformed":
                    r = await client.post(url + "/v1/completions", content=rng.choice(MALFORMED),
                                          headers={"content-type": "application/json"})
                    status, expected = r.status_code, 400
                elif kind == "stops":
                    status, _ = await _stream_text(client, url, {"prompt": prompt, "max_tokens": 40,
                                                                 "stop": LONG_STOPS})
                    expected = 200
                elif kind == "huge":
                    r = await client.post(url + "/v1/completions", json={"prompt": "abc " * 450_000, "max_tokens": 4})
                    status, expected = r.status_code, 400
                else:
                    r = await client.post(url + "/v1/chat/completions", json={
                        "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens})
                    status, expected = r.status_code, 200
            except httpx.HTTPError as exc:
                status, expected = f"client error {type(exc).__name__}", 200
            counts[f"{kind} {status}"] += 1
            if status != expected:
                unexpected.append((kind, status))


async def _latency(url: str, beside: dict | None) -> float:
    """Seconds for an 8-token greedy request, alone or while `beside` runs."""
    async with httpx.AsyncClient(headers=AUTH, timeout=300) as client:
        hostile = asyncio.create_task(client.post(url + "/v1/completions", json=beside)) if beside else None
        await asyncio.sleep(0.05 if beside else 0)
        t0 = time.perf_counter()
        r = await client.post(url + "/v1/completions", json={"prompt": "abc", "max_tokens": 8, "temperature": 0})
        seconds = time.perf_counter() - t0
        assert r.status_code == 200
        if hostile is not None:
            await hostile
        return seconds


def test_soak(tmp_path):
    seconds = float(os.environ.get("SPECDECODE_SOAK_SECONDS", 300))
    model, tok = tiny_hf_model("qwen2", seed=0), tiny_tokenizer()
    tok.chat_template = ROLE_CHAT
    target = save_tiny(tmp_path / "target", model, tok)
    draft = save_tiny(tmp_path / "draft", perturbed(model, 0.3, seed=1), tok)
    port = 8000 + os.getpid() % 1000
    exe = shutil.which("specdecode", path=str(Path(sys.executable).parent)) or "specdecode"
    server = subprocess.Popen([exe, "serve", "--target", str(target), "--draft", str(draft), "--port", str(port),
                               "--max-context", "512", "--log-level", "error"],
                              env=os.environ | {"SPECDECODE_API_KEY": KEY}, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 600
        while True:
            assert server.poll() is None, server.stderr.read()
            try:
                if httpx.get(url + "/health").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.time() < deadline
            time.sleep(0.5)
        greedy = {}  # each greedy request alone first: under load it must give the same text
        for prompt in PROMPTS:
            for max_tokens in (8, 24, 40):
                r = httpx.post(url + "/v1/completions", headers=AUTH, timeout=60,
                               json={"prompt": prompt, "max_tokens": max_tokens, "temperature": 0})
                greedy[prompt, max_tokens] = r.json()["choices"][0]["text"]
        latency = {"alone": asyncio.run(_latency(url, None)),
                   "beside an ordinary 200-token request": asyncio.run(_latency(url, {
                       "prompt": "abc", "max_tokens": 200})),
                   "beside 16 stop strings of 256 characters (200 tokens)": asyncio.run(_latency(url, {
                       "prompt": "abc", "max_tokens": 200, "stop": LONG_STOPS})),
                   "beside a 1.8 MB prompt": asyncio.run(_latency(url, {"prompt": "abc " * 450_000, "max_tokens": 4}))}
        counts: Counter = Counter()
        unexpected: list = []
        mismatches: list = []
        rss = {"start": _rss_mb(server.pid)}

        async def load() -> None:
            end = time.time() + seconds
            clients = [asyncio.create_task(_client(n, url, end, greedy, counts, unexpected, mismatches))
                       for n in range(CLIENTS)]
            await asyncio.sleep(seconds / 2)
            rss["middle"] = _rss_mb(server.pid)
            await asyncio.gather(*clients)

        asyncio.run(load())
        time.sleep(1)
        rss["end"] = _rss_mb(server.pid)
        metrics = {line.split(" ")[0]: float(line.split()[-1]) for line in
                   httpx.get(url + "/metrics", headers=AUTH).text.splitlines()
                   if line.startswith("specdecode_requests_total{")}
    finally:
        server.terminate()
        server.wait(timeout=60)
    report = {"seconds": seconds, "clients": CLIENTS, "requests": sum(counts.values()), "by_kind_and_status":
              dict(sorted(counts.items())), "server_metrics": metrics, "rss_mb": rss, "latency_seconds": latency,
              "unexpected": unexpected[:50], "greedy_mismatches": len(mismatches)}
    out = Path(os.environ.get("SPECDECODE_SOAK_REPORT", tmp_path / "soak.json"))
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))
    assert not unexpected, unexpected[:20]
    assert not mismatches, mismatches[:5]
    assert not [k for k in metrics if 'status="5' in k], metrics
    assert rss["end"] <= 1.15 * rss["middle"] + 50, rss  # flat after warming up: no growth per request
