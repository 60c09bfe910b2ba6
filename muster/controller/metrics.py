"""The controller's Prometheus metrics, served at /metrics."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.jobs = Gauge("muster_jobs", "Jobs by state", ["state"], registry=self.registry)
        self.agents = Gauge(
            "muster_agents_connected", "Agents with an open control link", registry=self.registry
        )
        self.placement = Histogram(
            "muster_placement_seconds",
            "Time from a scheduler pass's start to a gang's reservation",
            registry=self.registry,
            buckets=(0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5),
        )
        self.scheduler_pass = Histogram(
            "muster_scheduler_pass_seconds",
            "Whole scheduler passes over a non-empty queue, under the controller's lock",
            registry=self.registry,
            buckets=(0.005, 0.01, 0.02, 0.05, 0.1, 0.15, 0.2, 0.3, 0.5, 1, 2, 5),
        )
        self.log_lines = Counter(
            "muster_log_lines_ingested", "Log lines stored", registry=self.registry
        )
        self.frames_refused = Counter(
            "muster_frames_refused",
            "Control-link frames refused, by reason (auth, malformed, forged, replayed, foreign; "
            "poison: log lines the database refused; flood: LOGS past the in-flight bound)",
            ["reason"],
            registry=self.registry,
        )
        self.relayed_bytes = Counter(
            "muster_relayed_bytes",
            "Bytes relayed gangs' members sent through muster relays, as the relays metered them",
            registry=self.registry,
        )
        self.internal_errors = Counter(
            "muster_internal_errors",
            "Unexpected errors a long-running loop caught, logged and survived, by loop",
            ["loop"],
            registry=self.registry,
        )
