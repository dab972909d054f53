"""Prometheus metrics of the tokenizer manager (requests, tokens, latencies, KV usage).

Names and the `model_name` label are upstream SGLang's (`sglang:prompt_tokens_total`, ...;
prometheus_client adds `_total` to counters). Request metrics are observed here as outputs
arrive; scheduler gauges are refreshed from the scheduler's stats on each scrape (including
`sglang:spec_accept_length`, the worker's tokens per request per verify step, and PD's queue sizes).
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_TOKEN_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)


class MetricsCollector:
    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        self.labels = {"model_name": model_name}

        def made(metric):
            metric.labels(**self.labels)  # every series exists (at 0) from the start
            return metric

        def c(name: str, doc: str) -> Counter:
            return made(Counter(name, doc, labels, registry=self.registry))

        def g(name: str, doc: str) -> Gauge:
            return made(Gauge(name, doc, labels, registry=self.registry))

        def h(name: str, doc: str, buckets=_LATENCY_BUCKETS) -> Histogram:
            return made(Histogram(name, doc, labels, buckets=buckets, registry=self.registry))

        self.num_requests = c("sglang:num_requests", "Requests received")
        self.num_finished = c("sglang:num_requests_finished", "Requests finished (any reason)")
        self.num_aborted = c("sglang:num_aborted_requests", "Requests that ended with an abort (refused, client "
                             "gone, shutdown)")
        self.prompt_tokens = c("sglang:prompt_tokens", "Prompt tokens of requests")
        self.generation_tokens = c("sglang:generation_tokens", "Generated tokens")
        self.cached_tokens = c("sglang:cached_tokens", "Prompt tokens served from the prefix cache")
        self.ttft = h("sglang:time_to_first_token_seconds", "Time to first token")
        self.itl = h("sglang:inter_token_latency_seconds", "Time between consecutive output tokens",
                     _TOKEN_LATENCY_BUCKETS)
        self.tpot = h("sglang:time_per_output_token_seconds", "Time per output token after the first",
                      _TOKEN_LATENCY_BUCKETS)
        self.e2e = h("sglang:e2e_request_latency_seconds", "End-to-end request latency")
        self.num_running = g("sglang:num_running_reqs", "Requests running in the scheduler")
        self.num_waiting = g("sglang:num_queue_reqs", "Requests waiting in the scheduler")
        self.num_grammar_queue = g("sglang:num_grammar_queue_reqs",
                                   "Requests waiting for their grammar to compile (counted in num_queue_reqs too)")
        self.num_used = g("sglang:num_used_tokens", "KV cache tokens held by requests")
        self.kv_usage = g("sglang:token_usage", "KV cache tokens held by requests / capacity (the prefix cache's "
                          "evictable tokens count as free)")
        self.kv_total = g("sglang:max_total_num_tokens", "KV cache capacity in tokens")
        self.gen_throughput = g("sglang:gen_throughput", "Decode throughput (token/s) over the last "
                                "--decode-log-interval decode steps")
        self.cache_hit_rate = g("sglang:cache_hit_rate", "Prompt tokens served from the prefix cache / prompt tokens")
        self.spec_accept_length = g("sglang:spec_accept_length", "Speculative decoding: tokens produced per "
                                    "request per verify step (1 = no draft accepted; 0 without speculation)")
        # PD disaggregation's queues (upstream's names; 0 on servers of another mode)
        self.pd_queues = {
            "num_prefill_bootstrap_queue_reqs": g("sglang:num_prefill_bootstrap_queue_reqs", "PD prefill: requests "
                                                  "waiting for their decode server to preallocate (no KV held)"),
            "num_prefill_inflight_queue_reqs": g("sglang:num_prefill_inflight_queue_reqs", "PD prefill: prefilled "
                                                 "requests whose KV is being sent"),
            "num_decode_prealloc_queue_reqs": g("sglang:num_decode_prealloc_queue_reqs", "PD decode: requests "
                                                "waiting for KV memory to preallocate"),
            "num_decode_transfer_queue_reqs": g("sglang:num_decode_transfer_queue_reqs", "PD decode: preallocated "
                                                "requests waiting for their KV"),
        }

    def observe_request(self, prompt_tokens: int) -> None:
        self.num_requests.labels(**self.labels).inc()
        self.prompt_tokens.labels(**self.labels).inc(prompt_tokens)

    def observe_output(self, state, out) -> None:
        n_new = len(out.new_token_ids)
        if n_new:
            self.generation_tokens.labels(**self.labels).inc(n_new)
            if state.prev_token_time is not None:
                gap = (state.last_token_time - state.prev_token_time) / n_new
                self.itl.labels(**self.labels).observe(gap)
        if state.first_token_time is not None and state.meta["completion_tokens"] == n_new and n_new:
            self.ttft.labels(**self.labels).observe(state.first_token_time - state.created)
        if out.finished_reason is not None:
            now = time.monotonic()
            self.num_finished.labels(**self.labels).inc()
            if out.finished_reason.get("type") == "abort":
                self.num_aborted.labels(**self.labels).inc()
            self.cached_tokens.labels(**self.labels).inc(out.cached_tokens)
            self.e2e.labels(**self.labels).observe(now - state.created)
            n = state.meta["completion_tokens"]
            if n > 1 and state.first_token_time is not None:
                self.tpot.labels(**self.labels).observe((now - state.first_token_time) / (n - 1))

    def observe_scheduler(self, stats) -> None:
        self.num_running.labels(**self.labels).set(stats.num_running_reqs)
        self.num_waiting.labels(**self.labels).set(stats.num_waiting_reqs)
        self.num_grammar_queue.labels(**self.labels).set(stats.num_grammar_queue_reqs)
        self.num_used.labels(**self.labels).set(stats.num_used_tokens)
        self.kv_usage.labels(**self.labels).set(stats.num_used_tokens / max(stats.kv_total_tokens, 1))
        self.kv_total.labels(**self.labels).set(stats.kv_total_tokens)
        self.gen_throughput.labels(**self.labels).set(stats.gen_throughput)
        self.cache_hit_rate.labels(**self.labels).set(stats.cache_hit_rate)
        self.spec_accept_length.labels(**self.labels).set(stats.avg_spec_accept_length)
        for name, gauge in self.pd_queues.items():
            gauge.labels(**self.labels).set(getattr(stats, name))

    def render(self) -> bytes:
        return generate_latest(self.registry)
