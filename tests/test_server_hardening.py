"""A hostile client against the server: one request never fails or stalls another, work per request is bounded,
every endpoint but /health needs the key. Tiny models; each test is a regression test of an attack that once
worked."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch

from specdecode import cli
from specdecode.builder import build_generator
from specdecode.serving.scheduler import build_scheduler
from specdecode.errors import InvalidRequestError, ModelLoadError
from specdecode.kernels.build import build_lock
from specdecode.serving.app import create_app, serve_in_thread
from specdecode.serving.limits import MAX_STOP_CHARACTERS, MAX_STOP_STRINGS
from specdecode.stop_strings import StopStrings
from specdecode.verification.sampling import GREEDY_BELOW, SamplingParams, processed_probs

from .conftest import AUTH, MAX_CONTEXT, wait_idle


def _post(url: str, body, path: str = "/v1/completions", headers: dict | None = None, **kw) -> httpx.Response:
    kw = {"content": body} if isinstance(body, (str, bytes)) else {"json": body}
    return httpx.post(url + path, headers={"content-type": "application/json"} | AUTH | (headers or {}), timeout=60,
                      **kw)


# --- isolation: no accepted request can produce NaN; one sequence's error fails it alone -------------------------

def test_a_tiny_temperature_or_top_p_fails_no_one(server, monkeypatch):
    """Both once became 0 in float32: NaN probabilities, and the drafter's error failed every running request."""
    step = server.scheduler.step
    monkeypatch.setattr(server.scheduler, "step", lambda: (time.sleep(0.02), step()))  # the long one runs throughout
    greedy = server.reference.generate("hello world", max_new_tokens=24).text
    hostile = [{"temperature": 1e-300}, {"temperature": GREEDY_BELOW / 2}, {"temperature": 0.8, "top_p": 1e-300},
               {"temperature": 0.8, "top_p": 1e-45, "top_k": 1}]
    body = {"prompt": "Once upon a time", "max_tokens": 230, "temperature": 0, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, headers=AUTH, timeout=60) as long:
        lines = long.iter_lines()
        streamed = [next(lines)]  # the long request is running
        with ThreadPoolExecutor(len(hostile)) as pool:
            replies = list(pool.map(lambda h: _post(server.url, {"prompt": "hello world", "max_tokens": 24} | h),
                                    hostile))
        assert server.scheduler.running == 1  # the hostile ones ran beside it
        streamed += list(lines)
    for h, r in zip(hostile, replies):
        assert r.status_code == 200, (h, r.text)
        assert r.json()["choices"][0]["text"] == greedy, h  # greedy, or sampled from the top token alone
    assert long.status_code == 200
    text = "".join(json.loads(line[6:])["choices"][0]["text"] for line in streamed if line.startswith("data: {"))
    assert text == server.reference.generate("Once upon a time", max_new_tokens=230).text


def test_probabilities_stay_finite_at_extreme_parameters():
    logits = torch.randn(3, 50) * 30
    for params in (SamplingParams(GREEDY_BELOW), SamplingParams(1.0, top_p=1e-300), SamplingParams(2.0, top_p=1e-45),
                   SamplingParams(1e30), SamplingParams(GREEDY_BELOW, top_k=1, top_p=1e-300)):
        probs = processed_probs(logits, params)
        assert torch.isfinite(probs).all() and torch.allclose(probs.sum(-1), torch.ones(3)), params
    assert SamplingParams(1e-300).greedy and SamplingParams(GREEDY_BELOW / 2).greedy
    assert not SamplingParams(GREEDY_BELOW).greedy


def _poisoned(monkeypatch, obj, name: str, poisoned) -> None:
    """obj.name raises for any call whose arguments `poisoned` flags; the planted failure of one sequence."""
    real = getattr(obj, name)

    def call(*args, **kwargs):
        if poisoned(*args, **kwargs):
            raise RuntimeError("planted failure")
        return real(*args, **kwargs)

    monkeypatch.setattr(obj, name, call)


def _one_poisoned_among_three(server, poison_prompt: str, poison_seed: int | None = None) -> list[httpx.Response]:
    def one(body):
        return _post(server.url, body)

    bodies = [{"prompt": "abc def", "max_tokens": 30, "temperature": 0},
              {"prompt": poison_prompt, "max_tokens": 30, "temperature": 0.7, "seed": poison_seed or 5},
              {"prompt": "x1 y2 z3", "max_tokens": 30, "temperature": 0}]
    with ThreadPoolExecutor(3) as pool:
        replies = list(pool.map(one, bodies))
    wait_idle(server.scheduler)
    for body, r in zip(bodies, replies):
        if r.status_code == 200 and body["temperature"] == 0:
            assert r.json()["choices"][0]["text"] == server.reference.generate(body["prompt"], max_new_tokens=30).text
    return replies


def test_a_drafting_error_fails_its_sequence_alone(server, monkeypatch):
    """The drafter drafts for the whole batch at once; an error there used to end every running request."""
    _poisoned(monkeypatch, server.scheduler.drafter, "propose_batch",
              lambda requests: any(r.params.seed == 13 for r in requests))
    replies = _one_poisoned_among_three(server, "quick brown fox", poison_seed=13)
    assert [r.status_code for r in replies] == [200, 500, 200]
    assert "planted failure" in replies[1].json()["error"]["message"]


def test_a_target_forward_error_fails_its_sequence_alone(server, monkeypatch):
    long_prompt = "The cat sat on the mat " * 3  # 69 characters: only this sequence reaches position 60
    _poisoned(monkeypatch, server.scheduler, "target",
              lambda tokens, start, cache, **kw: bool((start >= 60).any()))
    replies = _one_poisoned_among_three(server, long_prompt)
    assert [r.status_code for r in replies] == [200, 500, 200]


# --- bounded work ---------------------------------------------------------------------------------------------------

class _CountingStr(str):
    """A stop string that counts the characters read from it: the stop check's work, without timing it."""

    reads = 0

    def __getitem__(self, i):
        _CountingStr.reads += 1
        return str.__getitem__(self, i)


def test_the_stop_check_works_in_time_linear_in_the_new_text():
    """Checking every stop string against the text after each token cost the square of its length: 16 stop strings
    of 65,536 characters stalled the scheduler's thread for seconds per request."""
    n = 4096
    stops = [_CountingStr("a" * (n - 1) + "b") for _ in range(4)]
    matcher = StopStrings(stops)
    _CountingStr.reads = 0
    fed = 0
    for _ in range(63):  # 63 "tokens" of 64 characters, each a step towards every stop string, none completing one
        assert matcher.feed("a" * 64) is None
        fed += 64
    assert matcher.held == fed  # all of it could still begin a stop string
    assert _CountingStr.reads <= 3 * fed * len(stops)  # amortised: a few reads per character per stop string
    assert matcher.feed("a" * (n - 1 - fed) + "b") == 0


@pytest.mark.parametrize("seed", range(40))
def test_stop_strings_match_a_brute_force_search(seed):
    import random

    rng = random.Random(seed)
    stops = ["".join(rng.choice("ab") for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(1, 3))]
    text = "".join(rng.choice("abc") for _ in range(rng.randint(0, 30)))
    matcher, at, fed = StopStrings(stops), None, 0
    while fed < len(text) and at is None:
        piece = text[fed:fed + rng.randint(1, 4)]
        at = matcher.feed(piece)
        fed += len(piece)
    ends = [(e, -len(s)) for e in range(len(text) + 1) for s in stops if text[:e].endswith(s)]
    first = min(ends, default=None)
    assert at == (None if first is None else first[0] + first[1]), (stops, text)
    if at is None:
        assert matcher.held == max((k for s in stops for k in range(len(s)) if text.endswith(s[:k])), default=0)


def test_long_stop_strings_are_refused_and_the_allowed_ones_work(server):
    each = MAX_STOP_CHARACTERS // MAX_STOP_STRINGS
    allowed = [chr(ord("a") + i) * each for i in range(MAX_STOP_STRINGS)]
    r = _post(server.url, {"prompt": "abc", "max_tokens": 8, "temperature": 0, "stop": allowed})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8
    r = _post(server.url, {"prompt": "abc", "max_tokens": 8, "stop": allowed[:-1] + [allowed[-1] + "z"]})
    assert r.status_code == 400 and str(MAX_STOP_CHARACTERS) in r.json()["error"]["message"]


def test_a_huge_prompt_is_refused_after_tokenizing_a_prefix_only(server, monkeypatch):
    tokenizer = server.scheduler.gen.tokenizer
    lengths: list[int] = []
    _poisoned(monkeypatch, tokenizer, "encode", lambda text, **kw: lengths.append(len(text)) and False)
    r = _post(server.url, {"prompt": "abc " * 2**18, "max_tokens": 4})  # 1 MiB
    assert r.status_code == 400 and "context" in r.json()["error"]["message"]
    assert lengths and max(lengths) <= 16 * MAX_CONTEXT
    r = _post(server.url, {"messages": [{"role": "user", "content": "abc " * 2**18}]}, "/v1/chat/completions")
    assert r.status_code == 400 and max(lengths) <= 16 * MAX_CONTEXT


def test_a_body_over_the_limit_gets_413_unread(tiny_pair):
    target, _ = tiny_pair
    scheduler = build_scheduler(target, drafter="none", max_batch=1, max_context=MAX_CONTEXT)
    with serve_in_thread(create_app(scheduler, "tiny", max_request_bytes=1000)) as url:
        body = json.dumps({"prompt": "a" * 2000, "max_tokens": 2})
        r = httpx.post(url + "/v1/completions", content=body, headers={"content-type": "application/json"})
        assert r.status_code == 413 and "1000 bytes" in r.json()["error"]["message"]

        def chunks():  # no Content-Length: the limit is counted as the body arrives
            for i in range(0, len(body), 100):
                yield body[i:i + 100].encode()

        r = httpx.post(url + "/v1/completions", content=chunks(), headers={"content-type": "application/json"})
        assert r.status_code == 413
        assert httpx.post(url + "/v1/completions", json={"prompt": "abc", "max_tokens": 2}).status_code == 200
        counted = httpx.get(url + "/metrics").text
        assert 'specdecode_requests_total{endpoint="/v1/completions",status="413"} 2.0' in counted


@pytest.mark.parametrize("body", [
    '{"prompt": "abc\\ud800", "max_tokens": 2}',
    '{"prompt": "abc", "max_tokens": 2, "stop": ["\\udfff"]}',
    '{"prompt": "abc", "max_tokens": 2, "model": "\\ud800"}',
    '{"prompt": "abc", "max_tokens": 2, "user": "\\ud800x"}'])
def test_lone_surrogates_get_a_400(server, body):
    r = _post(server.url, body)
    assert r.status_code == 400 and "surrogate" in r.json()["error"]["message"], r.text


def test_lone_surrogates_in_chat_and_in_the_library(server):
    r = _post(server.url, '{"messages": [{"role": "user", "content": "hi \\ud800"}]}', "/v1/chat/completions")
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("messages.0: content holds a lone")
    with pytest.raises(InvalidRequestError, match="surrogate"):
        server.reference.prepare("abc\ud800")


# --- auth ------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("path", ["/metrics", "/docs", "/redoc", "/openapi.json", "/v1/models", "/nowhere"])
def test_every_endpoint_but_health_needs_the_key(server, path):
    r = httpx.get(server.url + path)
    assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
    assert httpx.get(server.url + path, headers={"Authorization": "Bearer sk-tesT"}).status_code == 401
    assert httpx.get(server.url + path, headers=AUTH).status_code in (200, 404)
    assert httpx.get(server.url + "/health").status_code == 200


def test_the_key_is_checked_before_the_body_is_read(server):
    r = httpx.post(server.url + "/v1/completions", content=b"{" * 10_000_000, headers={"Authorization": "Bearer no"})
    assert r.status_code == 401  # not 413 or 400: nothing of the body was read


def test_open_metrics_leaves_only_metrics_open(tiny_pair):
    target, _ = tiny_pair
    scheduler = build_scheduler(target, drafter="none", max_batch=1, max_context=MAX_CONTEXT)
    with serve_in_thread(create_app(scheduler, "tiny", api_key="k", open_metrics=True)) as url:
        assert httpx.get(url + "/metrics").status_code == 200
        assert httpx.get(url + "/openapi.json").status_code == 401
    with pytest.raises(InvalidRequestError, match="empty"):
        create_app(scheduler, "tiny", api_key="")


def test_serve_takes_the_key_from_a_file_or_the_environment_never_an_argument(tmp_path, monkeypatch, capsys):
    with pytest.raises(SystemExit):
        cli.main(["serve", "--help"])
    help_text = capsys.readouterr().out
    assert "--api-key-file" in help_text and "SPECDECODE_API_KEY" in help_text and "--api-key " not in help_text
    key_file = tmp_path / "key"
    key_file.write_text("s3cret\n")
    assert cli._api_key(key_file) == "s3cret"
    monkeypatch.setenv("SPECDECODE_API_KEY", "from-env")
    assert cli._api_key(None) == "from-env"
    assert cli.main(["serve", "--target", "/nonexistent", "--api-key-file", str(tmp_path / "missing")]) != 0
    assert "cannot read the API key file" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["serve", "--api-key", "sk-secret"])  # not an abbreviation of --api-key-file
    assert "SPECDECODE_API_KEY" in capsys.readouterr().err


# --- smaller protocol points ------------------------------------------------------------------------------------------

def test_openapi_promises_what_the_server_sends(server):
    schema = httpx.get(server.url + "/openapi.json", headers=AUTH).json()
    for path in ("/v1/completions", "/v1/chat/completions"):
        responses = schema["paths"][path]["post"]["responses"]
        assert "422" not in responses and {"200", "400", "401", "413", "429"} <= set(responses)
    assert "HTTPValidationError" not in json.dumps(schema)
    assert _post(server.url, {"prompt": 3}).status_code == 400


def test_status_headers_and_messages(server):
    r = httpx.get(server.url + "/v1/completions", headers=AUTH)
    assert r.status_code == 405 and r.headers["allow"] == "POST"
    r = _post(server.url, "")
    assert r.status_code == 400 and r.json()["error"]["message"] == "the request has no body: send a JSON object"
    for field, value in (("max_tokens", "4"), ("stream", "yes"), ("temperature", "0.5"), ("seed", 1.0)):
        r = _post(server.url, {"prompt": "abc", field: value})
        assert r.status_code == 400 and field in r.json()["error"]["message"], (field, r.text)
    assert _post(server.url, {"prompt": "abc", "max_tokens": 2, "temperature": 1}).status_code == 200  # int for float
    r = _post(server.url, {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 10_000,
                           "max_completion_tokens": 2}, "/v1/chat/completions")
    assert r.status_code == 400 and "send one of them" in r.json()["error"]["message"]


def test_a_cancelled_stream_counts_as_499(server, monkeypatch):
    step = server.scheduler.step
    monkeypatch.setattr(server.scheduler, "step", lambda: (time.sleep(0.01), step()))

    def count() -> float:
        for line in httpx.get(server.url + "/metrics", headers=AUTH).text.splitlines():
            if line.startswith('specdecode_requests_total{endpoint="/v1/completions",status="499"}'):
                return float(line.split()[-1])
        return 0.0

    before = count()
    body = {"prompt": "hello world", "max_tokens": 200, "temperature": 0, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, headers=AUTH, timeout=60) as r:
        next(line for line in r.iter_lines() if line.startswith("data: "))
    wait_idle(server.scheduler)
    deadline = time.time() + 10
    while count() != before + 1 and time.time() < deadline:
        time.sleep(0.05)
    assert count() == before + 1


# --- loading ---------------------------------------------------------------------------------------------------------

def test_a_folder_without_a_tokenizer_is_a_clear_error(tmp_path):
    from specdecode.models.loading import load_model

    from .conftest import save_tiny, tiny_hf_model

    folder = save_tiny(tmp_path / "no-tokenizer", tiny_hf_model("qwen2"))
    with pytest.raises(ModelLoadError, match="has no tokenizer: expected one of tokenizer.json") as err:
        load_model(folder)
    assert str(folder) in str(err.value)


def test_a_broken_gguf_fails_before_promising_minutes_of_work(tmp_path, capsys):
    from specdecode.models.loading import load_model

    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + b"\x03\x00\x00\x00" + b"\xff" * 64)
    with pytest.raises(ModelLoadError):
        load_model(bad)
    assert "dequantizing" not in capsys.readouterr().err


_HOLD_LOCK = """
import sys, time
from pathlib import Path
from specdecode.kernels.build import build_lock
with build_lock(Path(sys.argv[1]), "test"):
    print("held", flush=True)
    time.sleep(float(sys.argv[2]))
"""


def test_a_dead_builders_lock_is_taken_over_at_once(tmp_path):
    (tmp_path / "lock").write_text("")  # torch's lock file, as a build killed a moment ago leaves it
    holder = subprocess.Popen([sys.executable, "-c", _HOLD_LOCK, str(tmp_path), "60"], stdout=subprocess.PIPE,
                              text=True)
    assert holder.stdout.readline() == "held\n"
    holder.kill()  # killed mid-build: its flock goes with it
    holder.wait()
    with build_lock(tmp_path, "test"):
        assert not (tmp_path / "lock").exists()


def test_a_live_builder_is_waited_for_with_a_message(tmp_path, capfd):
    holder = subprocess.Popen([sys.executable, "-c", _HOLD_LOCK, str(tmp_path), "1"], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline() == "held\n"
    got = threading.Event()

    def take() -> None:
        with build_lock(tmp_path, "test"):
            got.set()

    taker = threading.Thread(target=take)
    taker.start()
    taker.join(timeout=60)
    assert got.is_set() and holder.wait() == 0
    assert f"waiting for pid {holder.pid} to finish building the test kernels" in capfd.readouterr().err


def test_reference_generator_for_tiny_temperatures_is_greedy(tiny_pair):
    target, draft = tiny_pair
    gen = build_generator(target, draft=draft, drafter="model", max_context=MAX_CONTEXT)
    greedy = gen.generate("abc def", max_new_tokens=20)
    tiny = gen.generate("abc def", max_new_tokens=20, temperature=1e-300, seed=3)
    assert tiny.token_ids == greedy.token_ids
