"""Prometheus metrics of one app, in a registry of its own.

The engine's counts (queue, slots, tokens, speculation) are read from `engine.snapshot()` when
/metrics is scraped; the latencies are measured here, in the server, from the moment a request
arrives: time to the first token, time between tokens (each event's gap spread over its tokens)
and the whole request.
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from jaxmtp.engine.requests import Event

PREFIX = "jaxmtp_"
CONTENT_TYPE = CONTENT_TYPE_LATEST

# (snapshot key, metric name, help) of the engine's gauges and plain counters.
GAUGES = (("waiting", "requests_waiting", "requests queued for a slot"),
          ("running", "requests_running", "requests holding a slot (prefilling or decoding)"),
          ("prefilling", "requests_prefilling", "requests whose prompt is being prefilled"),
          ("slots", "slots", "decode slots of the engine (requests run at once, at most)"),
          ("max_queue", "queue_capacity", "requests the queue holds, at most"))
COUNTERS = (("prompt_tokens_total", "prompt_tokens", "prompt tokens of admitted requests"),
            ("cached_prompt_tokens_total", "cached_prompt_tokens",
             "prompt tokens whose cache entries came from the prefix store instead of a prefill"),
            ("generation_tokens_total", "generation_tokens", "tokens generated"),
            ("drafted_total", "draft_tokens", "tokens drafted by the MTP layer"),
            ("accepted_total", "accepted_draft_tokens", "drafted tokens the main model accepted"))


class EngineCollector:
    """The engine's snapshot as Prometheus metrics, read at each scrape."""

    def __init__(self, engine):
        self.engine = engine

    def collect(self):
        s = self.engine.snapshot()
        for key, name, text in GAUGES:
            yield GaugeMetricFamily(PREFIX + name, text, value=s[key])
        if s.get("current_k") is not None:
            yield GaugeMetricFamily(PREFIX + "speculative_k", "drafts per round the engine runs now",
                                    value=s["current_k"])
        for key, name, text in COUNTERS:
            yield CounterMetricFamily(PREFIX + name, text, value=s[key])
        finished = CounterMetricFamily(PREFIX + "requests_finished", "requests ended, by finish reason",
                                       labels=["reason"])
        for reason, n in sorted(s["requests_finished"].items()):
            finished.add_metric([str(reason)], n)
        yield finished
        rounds = CounterMetricFamily(PREFIX + "speculative_rounds", "decode rounds, by drafts per round (k)",
                                     labels=["k"])
        for k, n in sorted(s["rounds_by_k"].items()):
            rounds.add_metric([str(k)], n)
        yield rounds
        segments = CounterMetricFamily(PREFIX + "decode_segments", "decode segments, by the batch bucket they ran in "
                                       "(the compiled row count that held their live rows)", labels=["bucket"])
        for bucket, n in sorted(s["segments_by_bucket"].items()):
            segments.add_metric([str(bucket)], n)
        yield segments


class Metrics:
    """The app's registry: the engine's metrics and the server's latency histograms."""

    def __init__(self, engine):
        self.registry = CollectorRegistry()
        self.registry.register(EngineCollector(engine))
        self.first_token = Histogram(
            PREFIX + "time_to_first_token_seconds", "from a request's arrival to its first token",
            buckets=(.01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60, 120), registry=self.registry)
        self.inter_token = Histogram(
            PREFIX + "inter_token_latency_seconds", "between successive tokens of a request",
            buckets=(.001, .0025, .005, .01, .02, .04, .06, .08, .1, .25, .5, 1, 2.5), registry=self.registry)
        self.request = Histogram(
            PREFIX + "e2e_request_latency_seconds", "from a request's arrival to its last event",
            buckets=(.05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600), registry=self.registry)

    def timing(self, arrived: float) -> "Timing":
        return Timing(self, arrived)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class Timing:
    """One request's latencies, observed as its events arrive (on the engine's thread)."""

    def __init__(self, metrics: Metrics, arrived: float):
        self.metrics, self.arrived, self.last = metrics, arrived, None

    def observe(self, event: Event):
        now = time.perf_counter()
        if event.tokens:
            if self.last is None:
                self.metrics.first_token.observe(now - self.arrived)
            else:
                gap = (now - self.last) / len(event.tokens)
                for _ in event.tokens:
                    self.metrics.inter_token.observe(gap)
            self.last = now
        if event.finish_reason is not None:
            self.metrics.request.observe(now - self.arrived)
