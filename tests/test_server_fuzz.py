"""Schemathesis against our own OpenAPI document: every operation with generated valid and invalid bodies (a bounded,
seeded number per operation); no response may be a 5xx or differ from what the document promises."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from specdecode.serving.scheduler import build_scheduler
from specdecode.serving.app import create_app, serve_in_thread

from .conftest import perturbed, save_tiny, tiny_hf_model, tiny_tokenizer

KEY = "sk-fuzz"
AUTH = {"Authorization": f"Bearer {KEY}"}
# a chat template that adds a token per message, so that an empty message is still a prompt (as real templates)
ROLE_CHAT = "{% for m in messages %}{{ m['role'][0] }}{{ m['content'] }}{% endfor %}"
EXAMPLES = 100  # per operation and phase (docs/bench/2026-12-05-xeon-server-hardening: a run of 3,849 requests)


def schemathesis_command(url: str, examples: int, seed: int) -> list[str]:
    """`schemathesis run` against our server, with every check but the acceptance of schema-valid bodies: a prompt
    plus max_tokens over the context is valid per field and still refused (400)."""
    exe = shutil.which("schemathesis", path=str(Path(sys.executable).parent)) or "schemathesis"
    return [exe, "run", url + "/openapi.json", "-H", f"Authorization: Bearer {KEY}", "--max-examples", str(examples),
            "--seed", str(seed), "--exclude-checks", "positive_data_acceptance", "--no-color"]


def fuzz_server(tmp_path: Path, max_context: int = 128):
    from specdecode.models.loading import load_model

    model, tok = tiny_hf_model("qwen2", seed=0), tiny_tokenizer()
    tok.chat_template = ROLE_CHAT
    target = load_model(save_tiny(tmp_path / "target", model, tok), decode_width=9)
    draft = load_model(save_tiny(tmp_path / "draft", perturbed(model, 0.3, seed=1), tok))
    scheduler = build_scheduler(target, draft=draft, drafter="model", max_batch=4, max_context=max_context)
    return serve_in_thread(create_app(scheduler, "tiny", api_key=KEY))


def statuses(url: str) -> dict[str, float]:
    """Requests served so far by status code, from the server's own metrics."""
    counts: dict[str, float] = {}
    for line in httpx.get(url + "/metrics", headers=AUTH).text.splitlines():
        if line.startswith("specdecode_requests_total{"):
            status = line.split('status="')[1].split('"')[0]
            counts[status] = counts.get(status, 0) + float(line.split()[-1])
    return counts


def test_the_server_keeps_its_openapi_promises(tmp_path):
    pytest.importorskip("schemathesis")
    with fuzz_server(tmp_path) as url:
        run = subprocess.run(schemathesis_command(url, EXAMPLES, seed=1), capture_output=True, text=True, timeout=900)
        assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
        counts = statuses(url)
    assert sum(counts.values()) > 100 and counts.get("200", 0) > 10
    assert not [s for s in counts if s.startswith("5")], counts
