"""The OpenAI-compatible server, driven by the official `openai` client over loopback, on tiny models."""

from __future__ import annotations

import contextlib
import io
import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from specdecode import cli
from specdecode.builder import build_generator
from specdecode.serving.scheduler import build_scheduler
from specdecode.kernels import decode_ops
from specdecode.models.autotune import cpu_class
from specdecode.serving.app import create_app, serve_in_thread

from .conftest import API_KEY, AUTH, CHAT, MAX_CONTEXT, WORDS, wait_idle

def test_completion_greedy_equals_the_engine_and_reports_stats(server):
    r = server.client.completions.create(model="tiny", prompt="hello world", max_tokens=30, temperature=0)
    alone = server.reference.generate("hello world", max_new_tokens=30)
    assert r.choices[0].text == alone.text and r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 30 and r.usage.prompt_tokens == len("hello world")
    spec = r.model_extra["speculative"]
    assert spec["target_forward_passes"] == alone.stats.target_forward_passes
    assert 0 <= spec["acceptance_rate"] <= 1 and spec["mean_accepted_length"] >= 1


def test_completion_equals_the_generate_command(server):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cli.main(["generate", "--target", str(server.target.source), "--draft", str(server.draft.source),
                         "--prompt", "quick brown fox", "--max-new-tokens", "25", "--json"]) == 0
    printed = json.loads(out.getvalue())
    expected = printed["text"]
    # --dtype auto: float32 in the tests; dense linears pad every layer in bit-exact mode
    assert printed["target"] == {"dtype": "float32", "quant": "none", "lm_head": "none", "kernels": ["DenseLinear"],
                                 "cpu_class": cpu_class(), "decode_ops": decode_ops.extension() is not None,
                                 "padding": "every layer"}
    r = server.client.completions.create(model="tiny", prompt="quick brown fox", max_tokens=25, temperature=0)
    assert r.choices[0].text == expected


def test_chat_streaming_and_not(server):
    messages = [{"role": "user", "content": "Once upon a time"}]
    r = server.client.chat.completions.create(model="tiny", messages=messages, max_tokens=24, temperature=0)
    alone = server.reference.generate("Once upon a time", chat=True, max_new_tokens=24)
    assert r.choices[0].message.content == alone.text and r.choices[0].message.role == "assistant"
    assert r.object == "chat.completion" and r.model_extra["speculative"]["new_tokens"] == 24

    chunks = list(server.client.chat.completions.create(model="tiny", messages=messages, max_tokens=24,
                                                        temperature=0, stream=True,
                                                        stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == alone.text
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].choices[0].finish_reason == "length"
    assert finals[0].model_extra["speculative"]["accepted_tokens"] == alone.stats.accepted_tokens
    assert chunks[-1].usage.completion_tokens == 24 and chunks[-1].choices == []


def test_streaming_completion_with_a_stop_string(server):
    alone = server.reference.generate("abc def ghi", max_new_tokens=40)
    stop = alone.text[10:12]  # a string the greedy output is known to reach
    expected = server.reference.generate("abc def ghi", max_new_tokens=40, stop=[stop])
    stream = server.client.completions.create(model="tiny", prompt="abc def ghi", max_tokens=40, temperature=0,
                                              stop=stop, stream=True)
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks) == expected.text
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_seeded_sampling_is_reproducible(server):
    kw = dict(model="tiny", prompt="x1 y2 z3", max_tokens=20, temperature=0.9, top_p=0.9, seed=7,
              extra_body={"top_k": 20, "coupling": "gumbel"})
    a = server.client.completions.create(**kw).choices[0].text
    b = server.client.completions.create(**kw).choices[0].text
    plain = build_generator(server.target, drafter="none", max_context=MAX_CONTEXT)
    expected = plain.generate("x1 y2 z3", max_new_tokens=20, temperature=0.9, top_p=0.9, top_k=20, seed=7,
                              coupling="gumbel").text
    assert a == b == expected  # Gumbel coupling: the drafter changes nothing about a seeded output


def test_sixteen_concurrent_streaming_clients_match_their_single_outputs(server):
    prompts = [WORDS[i % len(WORDS)] + " " * (i // len(WORDS)) + str(i) for i in range(16)]
    steps_before = server.scheduler.steps

    def one(prompt: str) -> tuple[str, int]:
        chunks = list(server.client.completions.create(model="tiny", prompt=prompt, max_tokens=40, temperature=0,
                                                       stream=True))
        passes = chunks[-1].model_extra["speculative"]["target_forward_passes"]
        return "".join(c.choices[0].text for c in chunks), passes

    with ThreadPoolExecutor(16) as pool:
        replies = list(pool.map(one, prompts))
    for prompt, (text, _) in zip(prompts, replies):
        assert text == server.reference.generate(prompt, max_new_tokens=40).text
    # the requests' own verify steps, had each run alone; shared steps make far fewer
    assert server.scheduler.steps - steps_before < sum(passes for _, passes in replies) / 2
    wait_idle(server.scheduler)


def test_a_client_that_disconnects_frees_its_sequence(server, monkeypatch):
    step = server.scheduler.step
    monkeypatch.setattr(server.scheduler, "step", lambda: (time.sleep(0.01), step()))  # 200 tokens take seconds
    cancelled = server.scheduler.cancelled
    body = {"model": "tiny", "prompt": "hello world", "max_tokens": 200, "temperature": 0, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body,
                      headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: "):
                break  # one token arrived; now hang up
    wait_idle(server.scheduler)
    assert server.scheduler.cancelled == cancelled + 1  # dropped mid-way, not run to the end
    metrics = httpx.get(server.url + "/metrics", headers=AUTH).text
    assert "specdecode_num_requests_running 0.0" in metrics


def test_a_non_streaming_client_that_disconnects_frees_its_sequence(server, monkeypatch):
    step = server.scheduler.step
    monkeypatch.setattr(server.scheduler, "step", lambda: (time.sleep(0.01), step()))  # 200 tokens take seconds
    cancelled = server.scheduler.cancelled
    body = {"model": "tiny", "prompt": "hello world", "max_tokens": 200, "temperature": 0}
    with pytest.raises(httpx.ReadTimeout):  # the client gives up and closes the connection
        httpx.post(server.url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {API_KEY}"},
                   timeout=httpx.Timeout(30, read=0.5))
    wait_idle(server.scheduler)
    assert server.scheduler.cancelled == cancelled + 1


def test_one_failing_sequence_does_not_fail_its_batch(server, monkeypatch):
    """A request whose verification raises gets a 500 body; the others in the same steps finish normally."""
    import specdecode.sequence as engine_module

    real = engine_module.verify

    def failing_for_seed_13(logits, tokens, probs, params, generator, position):
        if params.seed == 13:
            raise RuntimeError("planted failure")
        return real(logits, tokens, probs, params, generator, position)

    monkeypatch.setattr(engine_module, "verify", failing_for_seed_13)

    def one(seed: int):
        return httpx.post(server.url + "/v1/completions", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60,
                          json={"prompt": "abc def", "max_tokens": 30, "temperature": 0.7, "seed": seed})

    with ThreadPoolExecutor(4) as pool:
        replies = list(pool.map(one, [11, 12, 13, 14]))
    assert [r.status_code for r in replies] == [200, 200, 500, 200]
    assert "planted failure" in replies[2].json()["error"]["message"]
    assert all(r.json()["usage"]["completion_tokens"] == 30 for r in replies if r.status_code == 200)
    wait_idle(server.scheduler)


def test_metrics_health_models_and_openapi(server):
    server.client.completions.create(model="tiny", prompt="abc", max_tokens=8, temperature=0)
    metrics = httpx.get(server.url + "/metrics", headers=AUTH).text
    for name in ["specdecode_spec_decode_num_drafts_total", "specdecode_spec_decode_num_draft_tokens_total",
                 "specdecode_spec_decode_num_accepted_tokens_total",
                 'specdecode_spec_decode_num_accepted_tokens_per_pos_total{position="0"}',
                 "specdecode_time_to_first_token_seconds_bucket", "specdecode_request_latency_seconds_bucket",
                 "specdecode_request_tokens_per_second_bucket", "specdecode_batch_size_bucket",
                 'specdecode_requests_total{endpoint="/v1/completions",status="200"}']:
        assert name in metrics, name
    drafted = next(float(line.split()[-1]) for line in metrics.splitlines()
                   if line.startswith("specdecode_spec_decode_num_draft_tokens_total"))
    assert drafted > 0
    assert httpx.get(server.url + "/health").json()["status"] == "ok"
    assert [m.id for m in server.client.models.list()] == ["tiny"]
    schema = httpx.get(server.url + "/openapi.json", headers=AUTH).json()
    assert {"/v1/completions", "/v1/chat/completions", "/v1/models"} <= set(schema["paths"])


BAD = [  # (body or raw text, status, words the message must contain)
    ('{"prompt": "abc", ', 400, "JSON"),
    ({"prompt": "abc", "max_tokens": 4, "frobnicate": 1}, 400, "frobnicate"),
    ({"prompt": "abc", "temperature": "hot"}, 400, "temperature"),
    ({"prompt": ["abc", "def"]}, 400, "one prompt"),
    ({"max_tokens": 4}, 400, "prompt"),
    ({"prompt": "abc", "max_tokens": 0}, 400, "max_tokens"),
    ({"prompt": "abc", "max_tokens": -3}, 400, "max_tokens"),
    ({"prompt": "abc", "max_tokens": 10_000}, 400, "context"),
    ({"prompt": "a" * (MAX_CONTEXT + 10), "max_tokens": 4}, 400, "context"),
    ({"prompt": "abc", "temperature": 5}, 400, "temperature"),
    ({"prompt": "abc", "top_p": 0}, 400, "top_p"),
    ({"prompt": "abc", "top_p": 1.5}, 400, "top_p"),
    ({"prompt": "abc", "top_k": -1}, 400, "top_k"),
    ({"prompt": "abc", "n": 2}, 400, "n"),
    ({"prompt": "abc", "stop": [""]}, 400, "stop"),
    ({"prompt": "abc", "coupling": "magic"}, 400, "coupling"),
    ({"prompt": [1, 2, 999]}, 400, "token ids"),
    ({"prompt": "abc", "model": "gpt-4"}, 404, "gpt-4"),
]


@pytest.mark.parametrize("body,status,words", BAD)
def test_bad_requests_get_openai_errors(server, body, status, words):
    kw = {"content": body, "headers": {"content-type": "application/json"}} if isinstance(body, str) else {"json": body}
    r = httpx.post(server.url + "/v1/completions", headers={"Authorization": f"Bearer {API_KEY}"} | kw.pop(
        "headers", {}), timeout=30, **kw)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert words.lower() in err["message"].lower() and err["type"]


@pytest.mark.parametrize("path,body", [("/v1/chat/completions", {"messages": []}),
                                       ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}),
                                       ("/v1/chat/completions", {"messages": [{"role": "user"}]})])
def test_bad_chat_requests(server, path, body):
    r = httpx.post(server.url + path, json=body, headers={"Authorization": f"Bearer {API_KEY}"})
    assert r.status_code == 400 and r.json()["error"]["message"]


def test_api_key_is_required(server):
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        r = httpx.post(server.url + "/v1/completions", json={"prompt": "abc"}, headers=headers)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="nope", max_retries=0).models.list()
    assert httpx.get(server.url + "/nowhere", headers=AUTH).json()["error"]["message"]


def test_a_full_queue_answers_429(tiny_pair):
    target, draft = tiny_pair
    scheduler = build_scheduler(target, drafter="none", max_batch=1, max_queue=0, max_context=MAX_CONTEXT)
    step = scheduler.step
    scheduler.step = lambda: (time.sleep(0.02), step())  # a slow model: the first request holds the slot for seconds
    with serve_in_thread(create_app(scheduler, "tiny")) as url:
        body = {"prompt": "hello", "max_tokens": 200, "temperature": 0, "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as first:
            lines = first.iter_lines()  # keep the iterator: dropping it closes the connection
            next(lines)  # the only slot is busy now
            r = httpx.post(url + "/v1/completions", json={"prompt": "abc", "max_tokens": 2})
            assert r.status_code == 429 and r.json()["error"]["type"] == "rate_limit_error"
        wait_idle(scheduler)
        assert httpx.post(url + "/v1/completions", json={"prompt": "abc", "max_tokens": 2}).status_code == 200


def test_serving_bench_end_to_end(tmp_path):
    from specdecode.bench.serving import serving_bench

    from .conftest import perturbed, save_tiny, tiny_hf_model, tiny_tokenizer

    model, tok = tiny_hf_model("qwen2", seed=0), tiny_tokenizer()
    tok.chat_template = CHAT
    target = save_tiny(tmp_path / "target", model, tok)
    draft = save_tiny(tmp_path / "draft", perturbed(model, 0.3, seed=1), tok)
    rows = serving_bench(str(target), str(draft), ("none", "model"), clients=(1, 3), max_batch=3,
                         requests_per_client=1, max_tokens=6, dtype="float32", max_context=512,
                         out=tmp_path / "out", progress=lambda _: None)
    assert [(r["drafter"], r["max_batch"], r["clients"]) for r in rows] == [
        ("none", 3, 1), ("none", 3, 3), ("none", 1, 3), ("model", 3, 1), ("model", 3, 3), ("model", 1, 3)]
    assert all(r["generated_tokens"] == 6 * r["clients"] and r["tokens_per_second"] > 0 for r in rows)
    assert rows[2]["mean_batch"] == 1
    table = (tmp_path / "out" / "serving.md").read_text()
    assert table.count("\n| ") == 6 and "CPU:" in table
