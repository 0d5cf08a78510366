"""Replicas of the server on Ray Serve (`specdecode serve --replicas N`, the `[cluster]` extra).

Each replica is one process holding the whole engine: its own models, scheduler (continuous batching) and the same
OpenAI app as `specdecode serve`. Ray routes each HTTP request to a replica, restarts a replica whose process dies
or whose scheduler stops (health checks), and spreads replicas over the nodes of a Ray cluster (`ray start` on each
machine). What lives in a replica stays there: a request's KV cache, and the cross-request memory of the `suffix`
drafters (each replica drafts from the answers it wrote itself). A request that was on a replica when it died gets
an error, not a hang: Ray fails it, or cuts its stream.

    client ──► Ray's HTTP proxy ──► replica 1: create_app(Scheduler) ──► /v1/...
                                └─► replica 2: create_app(Scheduler)
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from prometheus_client.exposition import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector
from ray import serve

from specdecode.errors import InvalidRequestError
from specdecode.serving.app import create_app
from specdecode.serving.limits import DEFAULT_MAX_REQUEST_BYTES

DEPLOYMENT = "specdecode"
REPLICA_HEADER = "x-specdecode-replica"  # on every response: which replica served it


@dataclass(frozen=True)
class ReplicaSettings:
    """What each replica builds: `build_scheduler`'s arguments, the app's, and its CPU threads."""

    target: str
    model_name: str
    threads: int = 1
    scheduler: dict = field(default_factory=dict)  # build_scheduler's keyword arguments (draft, drafter, ...)
    open_metrics: bool = False
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES


@serve.ingress()
class Replica:
    """One replica: the engine and its app (Ray calls `__serve_build_asgi_app__` after the constructor)."""

    def __init__(self, settings: ReplicaSettings, api_key: str | None) -> None:
        import torch

        from specdecode.serving.scheduler import build_scheduler

        torch.set_num_threads(settings.threads)
        self.settings, self.api_key = settings, api_key
        self.scheduler = build_scheduler(settings.target, **settings.scheduler)
        self.name = serve.get_replica_context().replica_id.unique_id

    def __serve_build_asgi_app__(self):
        app = create_app(self.scheduler, self.settings.model_name, self.api_key,
                         open_metrics=self.settings.open_metrics, max_request_bytes=self.settings.max_request_bytes,
                         gather_metrics=self._every_replicas_metrics)
        self.registry = app.state.metrics.registry

        @app.middleware("http")
        async def _name_the_replica(request, call_next):
            response = await call_next(request)
            response.headers[REPLICA_HEADER] = self.name
            return response

        return app

    def check_health(self) -> None:
        """Ray's health check: a replica whose scheduler has died is replaced."""
        if not self.scheduler.alive:
            raise RuntimeError("the scheduler's step loop has stopped")

    def identity(self) -> tuple[str, int]:
        """This replica's name (the responses' x-specdecode-replica) and its process id, e.g. for `kill`."""
        return self.name, os.getpid()

    def metrics_text(self) -> tuple[str, str]:
        """This replica's Prometheus exposition, with its name (called on every replica by `/metrics`)."""
        return self.name, generate_latest(self.registry).decode()

    async def _every_replicas_metrics(self) -> bytes:
        handle = serve.get_deployment_handle(DEPLOYMENT, app_name=serve.get_replica_context().app_name)
        texts = await handle.broadcast("metrics_text").results_async()
        return generate_latest(_Labelled(dict(texts)))


class _Labelled(Collector):
    """Every replica's metrics as one exposition, each sample labelled with its replica."""

    def __init__(self, texts: dict[str, str]) -> None:
        self.texts = texts

    def collect(self):
        families: dict[str, object] = {}
        for replica, text in sorted(self.texts.items()):
            for family in text_string_to_metric_families(text):
                merged = families.setdefault(family.name, family)
                samples = [s._replace(labels={**s.labels, "replica": replica}) for s in family.samples]
                if merged is family:
                    family.samples = samples
                else:
                    merged.samples.extend(samples)  # type: ignore[attr-defined]
        yield from families.values()


def start(address: str | None, host: str, port: int) -> None:
    """Join the Ray cluster at `address` (None: start one on this machine) and Serve's HTTP proxy on host:port."""
    import ray

    # our replicas keep their cores busy: on a small machine Ray's proxy can take longer than Serve's 5 s to start
    os.environ.setdefault("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S", "60")
    ray.init(address=address, include_dashboard=False)
    serve.start(http_options={"host": host, "port": port})


def check_replicas(replicas: int, threads: int) -> None:
    if replicas < 1 or threads < 1:
        raise InvalidRequestError(f"--replicas and --threads must be >= 1, got {replicas} and {threads}")


def application(settings: ReplicaSettings, replicas: int, api_key: str | None = None) -> serve.Application:
    """The Ray Serve application: `replicas` copies of the engine, each with `settings.threads` CPUs. Nothing starts
    until `serve.run` (or `serve run`) deploys it."""
    check_replicas(replicas, settings.threads)
    max_batch = settings.scheduler.get("max_batch", 8)
    max_queue = settings.scheduler.get("max_queue", 64)
    deployment = serve.deployment(
        name=DEPLOYMENT, num_replicas=replicas,
        ray_actor_options={"num_cpus": settings.threads},
        # Ray sends a replica no more than its batch plus its queue; beyond that requests wait in Ray's own queue
        max_ongoing_requests=max_batch + max_queue,
        health_check_period_s=5, health_check_timeout_s=30,
        graceful_shutdown_timeout_s=5)(Replica)
    return deployment.bind(settings, api_key)
