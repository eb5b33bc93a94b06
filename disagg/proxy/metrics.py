"""The proxy's Prometheus metrics, in a registry of its own (one per app, so
several proxies in one process, as in tests, never share counters).

Names (all prefixed ``disagg_proxy_``):

- ``requests_total{endpoint, path}``: generation requests by how they were
  served: ``split`` (prefill then decode), ``fallback`` (decode alone
  because prefill failed), ``colocated`` (one whole server), ``error``.
  ``local`` (decode alone by choice: see :mod:`disagg.proxy.routes`); a batch
  counts once (``fallback`` or ``local`` if any of its prompts was).
- ``local_routes_total{reason}``: prompts the decode engine computed itself by
  choice (n, prompt_logprobs, max_tokens_0, prompt_embeds, prompt_shape, unparsable).
- ``fallbacks_total{reason}``: why prefill was skipped (connect, timeout,
  status, disconnected, bad_reply, no_kv_params, no_healthy_prefill).
- ``upstream_errors_total{role, kind}``.
- ``rejected_total{reason}``: requests refused before any engine saw them
  (``concurrency``: over ``max_concurrency``, answered 429).
- ``active_requests``: client requests being served now.
- ``ttft_seconds``: request arrival -> first streamed event sent (streaming only).
- ``tpot_seconds``: (last token event - first) / (token events - 1), streaming, n=1.
- ``e2e_seconds``: request arrival -> last byte sent.
- ``prefill_seconds``: the prefill request alone.
- ``handoff_seconds``: prefill reply -> first decode event (streaming only).
- ``backend_in_flight{role, url}``, ``backend_healthy{role, url}``.
- ``backend_returns_total{role, url}``: times a backend came back into service after
  being taken out (a restarted engine); what the proxy measured about it is dropped then.

Routing (:mod:`disagg.proxy.policy`; named ``disagg_route_*``, without the proxy's prefix):

- ``disagg_route_total{path, reason}``: prompts by the path chosen (``split``,
  ``local``, ``whole``) and why (``predicted``, ``explore`` (re-measuring a path not taken
  for a while), ``policy``, ``decode_backlog`` / ``decode_load`` (``whole``), ``slo`` / ``slo_missed`` (with an SLO: the
  prompt has at least an even chance of meeting it, or not), ``no_prefill``, ``no_decode``, or a
  correctness reason to stay local: ``n``, ``prompt_logprobs``, ... see
  :mod:`disagg.proxy.routes`; ``colocated``).
- ``disagg_route_predicted_ttft_seconds{path}``: the policy's prediction for the chosen path.
- ``disagg_route_observed_ttft_seconds{path}``: the same prompts' TTFT as the proxy saw it
  (streamed single-prompt requests: arrival -> first event).
- ``disagg_route_predicted_tpot_seconds{path}`` and ``disagg_route_tpot_error_ratio{path}``: with
  an SLO, the predicted time per output token where the chosen path decodes, and per streamed
  reply its relative error against the reply's own (what the SLO routing calibrates with);
- ``disagg_route_ttft_error_ratio{path}``: per prompt, |predicted - observed| / observed TTFT
  (the prompts of both histograms above with a prediction); ``_sum / _count`` is the mean
  absolute relative error of the predictions for that path.
- ``disagg_route_samples_total{fit, outcome}``: live measurements (``fit``: ``engine`` prefill
  on an engine with nothing else in flight, ``engine_busy`` what an engine's load adds,
  ``link`` handoff, ``handoff_fixed``, a streamed handoff's fixed cost, or ``decode``, an
  engine's time per output token against its requests in flight) by what the fit made
  of them: ``used``, ``clipped`` (far above the prediction: entered as ``CLIP`` x it),
  ``discarded`` (an engine's or pair's first, warm-up), ``invalid``, ``queued`` (a prefill sent
  behind a queue: not a sample of the engine's line; see :mod:`disagg.proxy.measure`),
  ``decode_busy`` (a handoff that waited mostly for the decode engine's own queue: not a sample
  of the link; :mod:`disagg.proxy.router`), ``unfitted`` (``engine_busy``: no engine's line
  stands on samples yet).
- ``disagg_route_prompt_length_error_ratio``: mean |estimated - counted| / counted prompt tokens.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

#: relative errors of the routing's TTFT predictions: 1% .. 10x
ERROR_BUCKETS: tuple[float, ...] = (0.01, 0.025, 0.05, 0.1, 0.15, 0.2, 0.25, 0.3, 0.4, 0.5, 0.75, 1.0, 2.0, 5.0, 10.0)

#: fine around 1-3 s so a 2 s TTFT SLO can be read off the histogram
LATENCY_BUCKETS: tuple[float, ...] = (
    0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
    1.0, 1.25, 1.5, 1.75, 2.0, 2.25, 2.5, 3.0, 4.0, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)

#: per-token times: milliseconds up to a second
TOKEN_BUCKETS: tuple[float, ...] = (
    0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075,
    0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5)

PATHS = ("split", "fallback", "local", "whole", "colocated", "error")

CONTENT_TYPE = CONTENT_TYPE_LATEST


class ProxyMetrics:
    """All metrics of one proxy app, registered in ``self.registry``."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter("disagg_proxy_requests", "Generation requests by how they were served",
                                ["endpoint", "path"], registry=r)
        self.fallbacks = Counter("disagg_proxy_fallbacks", "Requests served by decode alone, by reason",
                                 ["reason"], registry=r)
        self.local_routes = Counter("disagg_proxy_local_routes", "Prompts the decode engine computed itself, by reason",
                                    ["reason"], registry=r)
        self.rejected = Counter("disagg_proxy_rejected", "Requests refused before reaching an engine, by reason",
                                ["reason"], registry=r)
        self.active = Gauge("disagg_proxy_active_requests", "Client requests being served", registry=r)
        self.upstream_errors = Counter("disagg_proxy_upstream_errors", "Failed engine requests",
                                       ["role", "kind"], registry=r)
        self.ttft = Histogram("disagg_proxy_ttft_seconds", "Time to first streamed event, at the proxy",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("disagg_proxy_tpot_seconds", "Time per output token after the first, at the proxy",
                              buckets=TOKEN_BUCKETS, registry=r)
        self.e2e = Histogram("disagg_proxy_e2e_seconds", "Request arrival to last byte sent",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.prefills_dropped = Counter(
            "disagg_proxy_prefills_dropped", "Prefill requests of streamed splits cancelled because they had "
            "not answered when decode's whole reply was relayed (their answer could no longer help it)", registry=r)
        self.prefill = Histogram("disagg_proxy_prefill_seconds", "Duration of the prefill request",
                                 buckets=LATENCY_BUCKETS, registry=r)
        self.handoff = Histogram("disagg_proxy_handoff_seconds", "Prefill reply to first decode event",
                                 buckets=LATENCY_BUCKETS, registry=r)
        self.in_flight = Gauge("disagg_proxy_backend_in_flight", "Requests outstanding at each backend",
                               ["role", "url"], registry=r)
        self.healthy = Gauge("disagg_proxy_backend_healthy", "1 while the backend passes health probes",
                             ["role", "url"], registry=r)
        self.returns = Counter("disagg_proxy_backend_returns", "Times a backend came back into service",
                               ["role", "url"], registry=r)
        self.kv_capacity = Gauge("disagg_proxy_backend_kv_capacity_tokens",
                                 "Tokens each backend's KV cache holds, as it declares (0: not known)",
                                 ["role", "url"], registry=r)

        self.route = Counter("disagg_route", "Prompts by the path the routing chose and why",
                             ["path", "reason"], registry=r)
        self.route_predicted = Histogram("disagg_route_predicted_ttft_seconds",
                                         "Predicted time to first token of the chosen path", ["path"],
                                         buckets=LATENCY_BUCKETS, registry=r)
        self.route_observed = Histogram("disagg_route_observed_ttft_seconds",
                                        "Observed time to first token, by the path taken", ["path"],
                                        buckets=LATENCY_BUCKETS, registry=r)
        self.route_error = Histogram("disagg_route_ttft_error_ratio",
                                     "Per prompt |predicted - observed| / observed TTFT, by the path taken", ["path"],
                                     buckets=ERROR_BUCKETS, registry=r)
        self.route_predicted_tpot = Histogram("disagg_route_predicted_tpot_seconds",
                                              "Predicted time per output token where the chosen path decodes "
                                              "(auto with an SLO, once that engine has a decode line)", ["path"],
                                              buckets=TOKEN_BUCKETS, registry=r)
        self.route_tpot_error = Histogram("disagg_route_tpot_error_ratio",
                                          "Per streamed reply |predicted - observed| / observed time per output "
                                          "token, by the path taken", ["path"], buckets=ERROR_BUCKETS, registry=r)
        self.route_samples = Counter("disagg_route_samples", "Live routing measurements by what the fits made of them",
                                     ["fit", "outcome"], registry=r)
        self.prompt_length_error = Gauge("disagg_route_prompt_length_error_ratio",
                                         "Mean relative error of the proxy's prompt-length estimate",
                                         registry=r)

    def render(self) -> bytes:
        """The text exposition format of every metric."""
        return generate_latest(self.registry)
