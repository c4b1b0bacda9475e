"""The server's Prometheus metrics (prometheus-client, one registry per server), named as
vLLM names its own where there is one, with the `fastqwen:` prefix."""
from __future__ import annotations

# Seconds: first tokens from a few ms (a short prompt on a GPU) to minutes (a long queue).
TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
                80.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4,
               0.5, 0.75, 1.0, 2.5)
# A prompt pass, from a few ms (a graph replay) to seconds (kernels compiling, a capture).
PASS_BUCKETS = (0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5, 5.0)
E2E_BUCKETS = (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0)


class Metrics:
    def __init__(self, model_name: str):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = CollectorRegistry()
        labels = {"model_name": model_name}
        self.labels = labels

        def named(kind, name, doc, **kw):
            return kind(f"fastqwen:{name}", doc, list(labels) + kw.pop("extra", []), registry=self.registry, **kw)

        self.requests = named(Counter, "request_success", "Requests finished, by finish reason",
                              extra=["finished_reason"])
        self.rejected = named(Counter, "request_rejected", "Requests refused before running, by HTTP status",
                              extra=["status"])
        self.prompt_tokens = named(Counter, "prompt_tokens", "Prompt tokens of requests that ran")
        self.generation_tokens = named(Counter, "generation_tokens", "Tokens generated")
        self.ttft = named(Histogram, "time_to_first_token_seconds", "Arrival to first token", buckets=TTFT_BUCKETS)
        self.itl = named(Histogram, "inter_token_latency_seconds", "Time between a request's tokens",
                         buckets=ITL_BUCKETS)
        self.e2e = named(Histogram, "e2e_request_latency_seconds", "Arrival to the last token", buckets=E2E_BUCKETS)
        self.running = named(Gauge, "num_requests_running", "Requests in a slot")
        self.running_peak = named(Gauge, "num_requests_running_peak", "The most requests in slots at once so far")
        self._peak = 0
        self.waiting = named(Gauge, "num_requests_waiting", "Requests queued for a slot")
        self.kv_usage = named(Gauge, "kv_cache_usage_perc", "The KV cache in use (1 = full): pages the running "
                              "requests hold over the pool's (paged cache), else their cached positions over all "
                              "slots' positions")
        self.prompt_pass = named(Histogram, "prompt_pass_seconds", "A prompt pass that ends in first tokens, from "
                                 "its start to those tokens on the host, by how it ran: group (one eager pass of "
                                 "several prompts of one length), eager, capture (its shape's CUDA graph captured, "
                                 "then run), graph (a replay)", buckets=PASS_BUCKETS, extra=["kind"])
        self.prefix_hit_tokens = named(Counter, "prefix_cache_hit_tokens", "Prompt positions taken from the "
                                       "pages of a shared prefix instead of prefilled (paged cache)")
        self.spec_drafts = named(Counter, "spec_decode_num_drafts", "Speculative verify steps")
        self.spec_draft_tokens = named(Counter, "spec_decode_num_draft_tokens", "Draft tokens verified")
        self.spec_accepted_tokens = named(Counter, "spec_decode_num_accepted_tokens", "Draft tokens accepted "
                                          "(acceptance = accepted / draft tokens)")

    def speculated(self, drafted: int, accepted: int) -> None:
        self.spec_drafts.labels(**self.labels).inc()
        self.spec_draft_tokens.labels(**self.labels).inc(drafted)
        self.spec_accepted_tokens.labels(**self.labels).inc(accepted)

    def pass_done(self, kind: str, seconds: float) -> None:
        self.prompt_pass.labels(**self.labels, kind=kind).observe(seconds)

    def prefix_hits(self, tokens: int) -> None:
        self.prefix_hit_tokens.labels(**self.labels).inc(tokens)

    def gauges(self, running: int, waiting: int, kv_usage: float) -> None:
        self.running.labels(**self.labels).set(running)
        if running > self._peak:
            self._peak = running
            self.running_peak.labels(**self.labels).set(running)
        self.waiting.labels(**self.labels).set(waiting)
        self.kv_usage.labels(**self.labels).set(kv_usage)

    def finished(self, req) -> None:
        self.requests.labels(**self.labels, finished_reason=req.finish_reason).inc()
        if req.first_token is None:
            return
        self.prompt_tokens.labels(**self.labels).inc(len(req.prompt))
        self.generation_tokens.labels(**self.labels).inc(len(req.output))
        self.ttft.labels(**self.labels).observe(req.first_token - req.arrived)
        for gap in req.latencies:
            self.itl.labels(**self.labels).observe(gap)
        self.e2e.labels(**self.labels).observe(req.last_token - req.arrived)

    def reject(self, status: int) -> None:
        self.rejected.labels(**self.labels, status=str(status)).inc()

    def render(self) -> bytes:
        from prometheus_client import generate_latest

        return generate_latest(self.registry)
