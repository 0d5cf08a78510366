"""Replicas on Ray Serve (`serve --replicas`): the deployment's configuration (no Ray started) and, with -m slow, a
local Ray cluster with two replicas of the tiny models."""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import socket
import time

import httpx
import openai
import pytest
from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from specdecode import cli
from specdecode.errors import InvalidRequestError
from specdecode.serving.cluster import REPLICA_HEADER, ReplicaSettings, _Labelled, application, start


def _settings(target: str = "t", draft: str | None = None, **scheduler) -> ReplicaSettings:
    # draft_quant none: no kernel timing in the replicas (a draft's kernel never changes the output)
    return ReplicaSettings(target=target, model_name="tiny", threads=1,
                           scheduler={"draft": draft, "drafter": "model", "max_batch": 4, "max_queue": 16,
                                      "draft_quant": "none", **scheduler})


def test_the_deployment_is_configured_without_starting_ray():
    import ray

    app = application(_settings(), replicas=3, api_key="k")
    deployment = app._bound_deployment  # what `serve.run` would deploy
    assert deployment.name == "specdecode" and deployment.num_replicas == 3
    assert deployment.ray_actor_options["num_cpus"] == 1
    assert deployment.max_ongoing_requests == 4 + 16  # a replica's batch and queue; the rest wait in Ray
    assert deployment.init_args == (_settings(), "k")
    assert not ray.is_initialized()


@pytest.mark.parametrize("replicas, threads", [(0, 1), (2, 0)])
def test_bad_replica_counts_are_refused(replicas, threads):
    with pytest.raises(InvalidRequestError, match="must be >= 1"):
        application(ReplicaSettings(target="t", model_name="m", threads=threads), replicas=replicas)


@pytest.mark.parametrize("argv, message", [
    (["--replicas", "0"], "must be >= 1"),
    (["--threads", "2"], "use it with --replicas"),
    (["--replicas", "2", "--threads", "64"], "cores; this machine has"),
    (["--replicas", "2", "--drafter", "model", "--gamma", "99"], "gamma must be"),
])
def test_serve_replicas_arguments_are_checked_before_anything_starts(argv, message, capsys, monkeypatch):
    import ray

    def no_load(*args, **kwargs):
        raise AssertionError("loaded a model before checking the arguments")

    monkeypatch.setattr("specdecode.serving.scheduler.build_scheduler", no_load)
    monkeypatch.setattr("specdecode.models.catalog.resolve", no_load)
    assert cli.main(["serve", *argv]) == 2
    assert message in capsys.readouterr().err
    assert not ray.is_initialized()


def test_metrics_of_every_replica_are_one_exposition_labelled_by_replica():
    texts = {}
    for name, n in (("a", 3), ("b", 5)):
        registry = CollectorRegistry()
        Counter("specdecode_requests", "HTTP requests", ["endpoint"], registry=registry).labels(endpoint="/x").inc(n)
        texts[name] = generate_latest(registry).decode()
    merged = generate_latest(_Labelled(texts)).decode()
    (family,) = text_string_to_metric_families(merged)
    assert family.name == "specdecode_requests" and merged.count("# HELP") == 1
    assert {(s.labels["replica"], s.value) for s in family.samples} == {("a", 3.0), ("b", 5.0)}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pid_of(replica: str) -> int:
    from ray import serve

    handle = serve.get_deployment_handle("specdecode", app_name="specdecode")
    return dict(handle.broadcast("identity").results())[replica]


@pytest.mark.slow
def test_two_replicas_on_ray_serve_equal_generate_and_survive_a_killed_replica(pair_dirs):
    import ray
    from ray import serve

    target, draft = pair_dirs
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cli.main(["generate", "--target", target, "--draft", draft, "--prompt", "quick brown fox",
                         "--max-new-tokens", "25", "--json"]) == 0
    expected = json.loads(out.getvalue())["text"]

    port = _free_port()
    try:
        start(None, "127.0.0.1", port)
        serve.run(application(_settings(target, draft, max_context=4096), replicas=2), name="specdecode",
                  route_prefix="/")
        url = f"http://127.0.0.1:{port}"
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)

        def ask() -> tuple[str, str]:
            raw = client.completions.with_raw_response.create(model="tiny", prompt="quick brown fox", max_tokens=25,
                                                              temperature=0)
            return raw.headers[REPLICA_HEADER], raw.parse().choices[0].text

        answers: dict[str, set[str]] = {}
        for _ in range(40):  # Ray picks replicas at random: both answer within a few requests
            replica, text = ask()
            answers.setdefault(replica, set()).add(text)
            if len(answers) == 2:
                break
        assert len(answers) == 2 and all(texts == {expected} for texts in answers.values())
        metrics = httpx.get(url + "/metrics").text
        assert all(f'replica="{r}"' in metrics for r in answers)

        # a stream in flight on a replica whose process is killed ends in an error, not a hang
        with client.completions.with_streaming_response.create(model="tiny", prompt="once upon a time",
                                                               max_tokens=3500, temperature=0, stream=True) as r:
            victim = r.headers[REPLICA_HEADER]
            lines = r.iter_lines()
            assert next(line for line in lines if line.startswith("data:"))
            os.kill(_pid_of(victim), signal.SIGKILL)
            killed = time.perf_counter()
            with pytest.raises(Exception) as cut:  # pytest.fail is no Exception: it goes through
                rest = list(lines)
                pytest.fail(f"the killed replica's stream ended without an error ({len(rest)} more lines, "
                            f"[DONE] {'in' if 'data: [DONE]' in rest else 'not in'} them)")
            # the HTTP client's error for a stream cut short (openai's client runs on an httpx fork, httpx2)
            assert type(cut.value).__name__ == "RemoteProtocolError" and "incomplete chunked read" in str(cut.value)

        # the next requests succeed, and the replica comes back (a new one, with another name)
        survivors = set(answers) - {victim}
        while True:
            replica, text = ask()
            assert text == expected
            if replica not in survivors:
                break
            assert time.perf_counter() - killed < 120, "the killed replica was not restarted"
        print(f"replica restarted and serving {time.perf_counter() - killed:.1f} s after the kill")
    finally:
        serve.shutdown()
        ray.shutdown()


def test_a_scheduler_whose_loop_died_is_not_alive(tiny_pair, monkeypatch):
    from specdecode.serving.scheduler import build_scheduler

    scheduler = build_scheduler(tiny_pair[0], drafter="ngram", max_batch=2)
    assert scheduler.alive  # not started yet
    monkeypatch.setattr(scheduler, "_loop", lambda: None)  # a loop that ends at once, as a bug in it would
    scheduler.start()
    scheduler._thread.join()
    assert not scheduler.alive  # what Ray's health check of a replica reads (Replica.check_health)
    scheduler.stop()
    assert scheduler.alive  # stopped on purpose
