"""The proxy's configuration: one frozen object, built once (from the ``disagg proxy``
arguments, or from a topology by ``disagg.launch.frontend.proxy_config``) and passed
down. The proxy knows only URLs, a handoff kind and its options."""

from __future__ import annotations

from dataclasses import dataclass, field
from urllib.parse import urlsplit

from disagg.errors import ProxyError
from disagg.serving import (
    EXPLORE_AFTER_DECISIONS,
    EXPLORE_AFTER_S,
    EXPLORE_WITHIN,
    FALLBACKS,
    PROXY_LOG_LEVELS,
    ROUTING_POLICIES,
)

#: environment variable read when ``--api-key`` is not given (keeps the key out of ``ps``)
API_KEY_ENV = "DISAGG_PROXY_API_KEY"
#: the engine key the proxy sends to every engine (``Authorization: Bearer KEY``); ``disagg up``
#: puts the run's key here, and takes it from here instead of generating one when it is set
ENGINE_KEY_ENV = "DISAGG_ENGINE_KEY"

#: the handoff that streams the KV while the prefill computes (``SocketStreamHandoff.kind``), the one
#: ``RoutingConfig.streaming_layers`` is for
STREAMING_HANDOFF = "vllm-socket-stream"
#: the roles whose engines have a seed prefill rate (``RoutingConfig.measured_rates`` names some of them)
SEED_ROLES = ("prefill", "decode")

#: client requests the proxy serves at once before it answers 429 (generation and
#: pass-through; /health and /metrics never count): far above what one pair of
#: engines runs at once (vLLM's --max-num-seqs), so only a flood is refused
DEFAULT_MAX_CONCURRENCY = 1024
#: prompts in one request (a ``/v1/completions`` list); more get a 400 (each prompt of a split
#: batch is an engine request of its own)
DEFAULT_MAX_PROMPTS = 1024
#: largest client request body, bytes (long prompts, base64 images); larger gets 413
DEFAULT_MAX_BODY_BYTES = 64 * 1024 * 1024


@dataclass(frozen=True)
class ProxyTimeouts:
    """Every wait of the proxy, in seconds."""

    connect: float = 10.0           # opening a connection to an engine
    request: float = 600.0          # an engine's reply, or the next chunk of a stream
    health_interval: float = 2.0    # between two probe rounds of every backend
    health_timeout: float = 5.0     # one GET /health probe
    drain: float = 15.0             # SIGTERM: how long in-flight requests may finish
    #: a client's side, as nginx's client_header_timeout, client_body_timeout and send_timeout:
    client_header: float = 60.0     # a connection's request line and headers (also an idle keep-alive)
    client_body: float = 60.0       # the whole request body, once the headers are in
    send: float = 60.0              # one write to a client that stopped reading (a stream)

    def __post_init__(self) -> None:
        for name in ("connect", "request", "health_interval", "health_timeout", "drain", "client_header",
                     "client_body", "send"):
            value = getattr(self, name)
            if not value > 0:
                raise ProxyError(f"proxy timeout {name} must be > 0 seconds, got {value!r}")


def check_key(value: str | None, what: str) -> str | None:
    """``value`` if it can be a bearer token (non-empty printable ASCII, no spaces), or None; else ProxyError.

    The message names ``what`` (the setting or variable), never the value.
    """
    if value is None:
        return None
    if not value:
        raise ProxyError(f"{what} must not be empty (leave it unset for no key)")
    if not all("!" <= ch <= "~" for ch in value):
        raise ProxyError(f"{what} must be printable ASCII without spaces (it goes in an Authorization header)")
    return value


def normalize_url(url: str, what: str) -> str:
    """``http://host:port`` without a trailing slash; raises :class:`ProxyError` naming ``what``."""
    parts = urlsplit(url.strip())
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ProxyError(f"{what} URL {url!r} is not an http(s)://host:port URL")
    try:
        parts.port  # noqa: B018 (validates the port)
    except ValueError as exc:
        raise ProxyError(f"{what} URL {url!r}: {exc}") from None
    if parts.query or parts.fragment:
        raise ProxyError(f"{what} URL {url!r} must not carry a query or fragment")
    return url.strip().rstrip("/")




@dataclass(frozen=True)
class RoutingConfig:
    """How each prompt is routed, and the numbers the ``auto`` policy starts from.

    ``split`` (the default here, as before routing existed) splits every prompt
    that can be split; ``local`` lets decode engines prefill every prompt;
    ``auto`` predicts each prompt's TTFT on every path (:mod:`disagg.routecost`)
    from live measurements, seeded with these figures, which ``disagg up``
    derives from the topology (``disagg.planning.route_seeds``): rates in tokens
    or bytes per second, times in seconds. ``whole``: a prefill engine may serve
    a request alone (its connector lets it: vLLM with NIXL or the socket
    connector). ``tokenizer``: the model's ``tokenizer.json`` for exact prompt
    lengths; without it, characters / ``chars_per_token`` (calibrated live).
    ``explore_*``: when ``auto`` re-measures a path it has not taken
    (:class:`disagg.proxy.policy.Explorer`; ``explore_within`` 0: never).
    ``streaming_layers``: the handoff streams the KV layer by layer while the prefill
    computes (``vllm-socket-stream``), over a model of that many layers: a split is
    predicted with only the part of the transfer the prefill does not hide
    (:func:`disagg.routecost.exposed_transfer_s`; 1 hides nothing) and splits teach the
    link nothing (:class:`disagg.proxy.router.Router`); None: the KV moves after the prefill.
    ``measured_rates``: the roles whose seed rate was measured on their hosts; an engine not
    measured live yet is priced at such a seed as it is, and only an estimated seed is scaled by
    what live measurements say of the estimates (:meth:`disagg.proxy.measure.Measurements._line`).
    """

    policy: str = "split"
    kv_bytes_per_token: float | None = None
    prefill_tokens_per_s: float | None = None
    decode_tokens_per_s: float | None = None      # local prefill on a decode engine (default: prefill's)
    link_bytes_per_s: float | None = None
    handoff_fixed_s: float | None = None          # default: disagg.routecost.DEFAULT_HANDOFF_FIXED_S
    overhead_s: float = 0.0                       # per-request engine cost besides the prompt's tokens
    stall_weight: float = 1.0                     # seconds of TTFT one second of stalled decode is worth
    whole: bool = False
    tokenizer: str | None = None
    chars_per_token: float = 4.0
    explore_after_s: float = EXPLORE_AFTER_S
    explore_decisions: int = EXPLORE_AFTER_DECISIONS
    explore_within: float = EXPLORE_WITHIN
    streaming_layers: int | None = None
    #: the roles ("prefill", "decode") whose seed rate was measured (``disagg bench``), not estimated
    measured_rates: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.policy not in ROUTING_POLICIES:
            raise ProxyError(f"routing policy must be one of {', '.join(ROUTING_POLICIES)}, got {self.policy!r}")
        for name in ("kv_bytes_per_token", "prefill_tokens_per_s", "decode_tokens_per_s", "link_bytes_per_s",
                     "handoff_fixed_s"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, (int, float)) and value >= 0 and value < float("inf")):
                raise ProxyError(f"routing {name} must be a number >= 0, got {value!r}")
        for name in ("prefill_tokens_per_s", "link_bytes_per_s", "decode_tokens_per_s"):
            if getattr(self, name) == 0:
                raise ProxyError(f"routing {name} must be > 0")
        if not self.chars_per_token > 0 or self.overhead_s < 0 or self.stall_weight < 0:
            raise ProxyError("routing chars_per_token must be > 0, overhead_s and stall_weight >= 0")
        if not (self.explore_after_s >= 0 and self.explore_decisions >= 1
                and (self.explore_within == 0 or self.explore_within > 1)):
            raise ProxyError("routing exploration: after >= 0 seconds, decisions >= 1, within > 1 (0: never), "
                             f"got {self.explore_after_s!r}, {self.explore_decisions!r}, {self.explore_within!r}")
        if self.streaming_layers is not None and (type(self.streaming_layers) is not int or self.streaming_layers < 1):
            raise ProxyError(f"routing streaming_layers must be a whole number >= 1 (the model's layers), "
                             f"got {self.streaming_layers!r}")
        if not (isinstance(self.measured_rates, tuple) and set(self.measured_rates) <= set(SEED_ROLES)):
            raise ProxyError(f"routing measured_rates must name roles among {', '.join(SEED_ROLES)}, "
                             f"got {self.measured_rates!r}")
        if "decode" in self.measured_rates and self.decode_tokens_per_s is None:
            raise ProxyError("routing measured_rates names decode but no decode rate is given "
                             "(--route-decode-rate): the decode engines would take the prefill rate as measured")
        if self.policy == "auto":
            missing = [n for n in ("kv_bytes_per_token", "prefill_tokens_per_s", "link_bytes_per_s")
                       if getattr(self, n) is None]
            if missing:
                raise ProxyError(f"routing policy auto needs its seed figures: {', '.join(missing)} "
                                 "(--route-kv-bytes-per-token, --route-prefill-rate, --route-link-rate)")

    def to_argv(self) -> list[str]:
        """The ``disagg proxy`` arguments that rebuild this routing configuration."""
        argv = ["--routing-policy", self.policy]
        for flag, value in (("--route-kv-bytes-per-token", self.kv_bytes_per_token),
                            ("--route-prefill-rate", self.prefill_tokens_per_s),
                            ("--route-decode-rate", self.decode_tokens_per_s),
                            ("--route-link-rate", self.link_bytes_per_s),
                            ("--route-handoff-fixed", self.handoff_fixed_s)):
            if value is not None:
                argv += [flag, repr(float(value))]
        argv += ["--route-overhead", repr(self.overhead_s), "--route-stall-weight", repr(self.stall_weight),
                 "--route-chars-per-token", repr(self.chars_per_token),
                 "--route-explore-after", repr(self.explore_after_s),
                 "--route-explore-decisions", str(self.explore_decisions),
                 "--route-explore-within", repr(self.explore_within)]
        if self.streaming_layers is not None:
            argv += ["--route-streaming-layers", str(self.streaming_layers)]
        if self.measured_rates:
            argv += ["--route-measured-rates", ",".join(self.measured_rates)]
        if self.whole:
            argv.append("--route-whole")
        if self.tokenizer:
            argv += ["--tokenizer", self.tokenizer]
        return argv


@dataclass(frozen=True)
class ProxyConfig:
    """Everything the proxy needs.

    ``prefill`` empty means colocated mode: ``decode`` lists whole servers and
    each request goes whole to one of them (plain load balancing, no handoff).
    """

    decode: tuple[str, ...]
    prefill: tuple[str, ...] = ()
    host: str = "127.0.0.1"
    port: int = 8000
    handoff: str = "vllm"
    api_key: str | None = None
    #: sent as ``Authorization: Bearer KEY`` with every request to an engine (``disagg up``
    #: generates one per run and guards the engines with it); like ``api_key``, never in argv
    engine_key: str | None = field(default=None, repr=False)
    fallback: str = "local"
    #: requests served at once; one more is answered 429 with Retry-After
    max_concurrency: int = DEFAULT_MAX_CONCURRENCY
    #: prompts in one request; more are answered 400
    max_prompts: int = DEFAULT_MAX_PROMPTS
    #: largest request body in bytes; larger is answered 413
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    timeouts: ProxyTimeouts = field(default_factory=ProxyTimeouts)
    #: engine-specific handoff settings (``--handoff-option KEY=VALUE``), e.g.
    #: SGLang's ``bootstrap_ports``; each handoff reads the keys it needs
    handoff_options: tuple[tuple[str, str], ...] = ()
    #: the per-prompt routing policy and its seed figures
    routing: RoutingConfig = field(default_factory=RoutingConfig)
    #: ``info`` or ``debug`` (a line per routing decision and per prompt's first token)
    log_level: str = "info"

    def __post_init__(self) -> None:
        if not self.decode:
            raise ProxyError("the proxy needs at least one --decode URL")
        object.__setattr__(self, "decode", tuple(normalize_url(u, "decode") for u in self.decode))
        object.__setattr__(self, "prefill", tuple(normalize_url(u, "prefill") for u in self.prefill))
        for role in ("prefill", "decode"):
            urls = getattr(self, role)
            if len(set(urls)) != len(urls):
                raise ProxyError(f"{role} URLs repeat: {', '.join(urls)}")
        if self.log_level not in PROXY_LOG_LEVELS:
            raise ProxyError(f"log_level must be one of {', '.join(PROXY_LOG_LEVELS)}, got {self.log_level!r}")
        if self.fallback not in FALLBACKS:
            raise ProxyError(f"fallback must be one of {', '.join(FALLBACKS)}, got {self.fallback!r}")
        for name in ("max_concurrency", "max_prompts", "max_body_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ProxyError(f"{name} must be a whole number >= 1, got {value!r}")
        if not 0 <= self.port <= 65535:
            raise ProxyError(f"proxy port {self.port} is not in 0..65535")
        if self.api_key is not None and not self.api_key:
            raise ProxyError("api_key must not be empty (leave it unset for no key)")
        check_key(self.engine_key, "engine_key")
        keys = [k for k, _ in self.handoff_options]
        if any(not k for k in keys) or len(set(keys)) != len(keys):
            raise ProxyError(f"handoff options need distinct non-empty keys, got {', '.join(keys) or '(none)'}")
        streamed = self.handoff == STREAMING_HANDOFF
        if self.routing.streaming_layers is not None and not streamed:
            raise ProxyError(f"routing streaming_layers (--route-streaming-layers) prices the {STREAMING_HANDOFF} "
                             f"handoff; handoff {self.handoff} sends the KV after the prefill")
        if streamed and self.prefill and self.routing.policy == "auto" and self.routing.streaming_layers is None:
            raise ProxyError(f"routing policy auto with handoff {STREAMING_HANDOFF} needs "
                             "--route-streaming-layers N (the model's layers; 1 prices the handoff as if "
                             "the KV followed the prefill)")

    @property
    def colocated(self) -> bool:
        """True when there is no prefill pool (plain load balancer)."""
        return not self.prefill

    def to_argv(self, *, with_api_key: bool = True) -> list[str]:
        """The ``disagg proxy ...`` arguments (after ``disagg``) that rebuild this config.

        ``with_api_key=False`` leaves both keys (``api_key`` and ``engine_key``)
        out, for a caller that passes them in the environment instead (``ps``
        shows every process's argv).
        """
        t = self.timeouts
        argv = ["proxy", "--host", self.host, "--port", str(self.port)]
        if self.prefill:
            argv += ["--prefill", *self.prefill]
        argv += ["--decode", *self.decode, "--handoff", self.handoff, "--fallback", self.fallback,
                 "--max-concurrency", str(self.max_concurrency), "--max-prompts", str(self.max_prompts),
                 "--max-body-bytes", str(self.max_body_bytes),
                 "--connect-timeout", str(t.connect), "--request-timeout", str(t.request),
                 "--health-interval", str(t.health_interval), "--health-timeout", str(t.health_timeout),
                 "--drain-timeout", str(t.drain), "--client-header-timeout", str(t.client_header),
                 "--client-body-timeout", str(t.client_body), "--send-timeout", str(t.send)]
        if self.api_key and with_api_key:
            argv += ["--api-key", self.api_key]
        if self.engine_key and with_api_key:
            argv += ["--engine-key", self.engine_key]
        for key, value in self.handoff_options:
            argv += ["--handoff-option", f"{key}={value}"]
        if self.prefill and self.routing != RoutingConfig():
            argv += self.routing.to_argv()
        if self.log_level != "info":
            argv += ["--log-level", self.log_level]
        return argv
