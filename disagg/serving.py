"""Names and defaults of the serving path that the topology file and the proxy's options both use.

One owner for each: :mod:`disagg.topology` validates a file against these, and
:mod:`disagg.proxy.config` its command-line options (the proxy reads no topology).
"""

from __future__ import annotations

#: ``--handoff``: the proxy's KV handoff protocols, each a class of the proxy
#: (:data:`disagg.proxy.handoff.HANDOFFS`) and named by the engine and KV adapters whose engines
#: speak it (``disagg.engines.base.EngineAdapter.handoff``)
VLLM_HANDOFF = "vllm"                       # vLLM, prefill then decode (NIXL pull, the socket connector)
SGLANG_HANDOFF = "sglang"                   # SGLang's P/D router protocol
LMCACHE_HANDOFF = "vllm-lmcache"            # vLLM + LMCache (ZMQ notices)
STREAMING_HANDOFF = "vllm-socket-stream"    # vLLM + socket connector, the KV streamed while prefill computes
NIXL_PUSH_HANDOFF = "vllm-nixl-push"        # vLLM + NixlPushConnector
#: the streaming handoff's option: each ``--prefill`` URL's KV listener (``H1:P1,H2:P2``)
KV_PEERS = "kv_peers"

#: ``proxy.fallback`` / ``--fallback``: when prefill fails, decode serves alone (local) or the
#: request fails with 503 (never)
FALLBACKS = ("local", "never")

#: ``routing.policy`` / ``--routing-policy``: ``auto`` predicts the fastest of split / local /
#: whole per prompt (:mod:`disagg.routecost`), ``split`` always splits, ``local`` never does
ROUTING_POLICIES = ("auto", "split", "local")

#: ``routing.explore`` / ``--route-explore-*``: under ``auto``, a path not taken for
#: EXPLORE_AFTER_S seconds and EXPLORE_AFTER_DECISIONS decisions whose score is within
#: EXPLORE_WITHIN x the best one's gets one prompt to re-measure it (within 0: never)
EXPLORE_AFTER_S = 60.0
EXPLORE_AFTER_DECISIONS = 50
EXPLORE_WITHIN = 2.0

#: under ``auto`` without an SLO, a prefill engine is offered ``whole`` when one more decode would take more
#: than this factor x its time per output token on every decode engine
#: (:mod:`disagg.proxy.policy`, the ``decode_load`` rule); the option then competes on its score.
#: 1.0 (offered whenever the decode side would decode slower) replaced a 1.25 margin after 20
#: workloads at saturation (docs/results.md, 2026-12-03 22:29-23:09): mean goodput +3%, worst
#: repeat 95 good requests of 120 instead of 78, per-workload wins and losses even. 1.05, not 1.0:
#: the time per output token is a decode step over 1 - the engine's prefill duty, and one short
#: prompt prefilled on a decode engine (a few ms in the duty's 10 s) made it decode a fraction of
#: a percent slower than an idle prefill engine on the same line, which offered ``whole`` to prompts
#: that any decode engine served as well
WHOLE_TPOT_FACTOR = 1.05

#: ``proxy.log_level`` / ``--log-level``: ``debug`` adds one line per routing decision (every
#: option's predicted TTFT) and one per prompt's first token (observed against predicted)
PROXY_LOG_LEVELS = ("info", "debug")

#: the proxy's waits, in seconds: the defaults of a topology's ``timeouts:`` (:class:`disagg.topology.Timeouts`,
#: which ``disagg up`` hands the proxy) and of ``disagg proxy``'s flags (:class:`disagg.proxy.config.ProxyTimeouts`)
CONNECT_TIMEOUT_S = 10.0            # opening a connection to an engine
REQUEST_TIMEOUT_S = 600.0           # an engine's reply, or the next chunk of its stream
HEALTH_INTERVAL_S = 2.0             # between two health probe rounds of every engine
HEALTH_TIMEOUT_S = 5.0              # one GET /health probe
DRAIN_TIMEOUT_S = 15.0              # SIGTERM: how long in-flight requests may finish
CLIENT_HEADER_TIMEOUT_S = 60.0      # a client connection's request line and headers (also an idle keep-alive)
CLIENT_BODY_TIMEOUT_S = 60.0        # a client's whole request body, once its headers are in
SEND_TIMEOUT_S = 60.0               # one write to a client that stopped reading (a stream)
