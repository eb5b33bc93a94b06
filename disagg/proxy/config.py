"""The proxy's configuration: one frozen object, built once (from the ``disagg proxy``
arguments, or from a topology by ``disagg.launch.frontend.proxy_config``) and passed
down. The proxy knows only URLs, a handoff kind and its options.

Each setting is declared once, as a field here: its ``flag(...)`` says how ``disagg proxy``
spells it, and :mod:`disagg.proxy.flags` makes the arguments, the argv that rebuilds a config
(:meth:`ProxyConfig.to_argv`) and the config from parsed arguments (:meth:`ProxyConfig.from_args`)
from those declarations."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from disagg.errors import ProxyError
from disagg.proxy import flags
from disagg.proxy.flags import flag
from disagg.routecost import ServiceObjective
from disagg.serving import (
    CLIENT_BODY_TIMEOUT_S,
    CLIENT_HEADER_TIMEOUT_S,
    CONNECT_TIMEOUT_S,
    DRAIN_TIMEOUT_S,
    EXPLORE_AFTER_DECISIONS,
    EXPLORE_AFTER_S,
    EXPLORE_WITHIN,
    FALLBACKS,
    HEALTH_INTERVAL_S,
    HEALTH_TIMEOUT_S,
    PROXY_LOG_LEVELS,
    REQUEST_TIMEOUT_S,
    ROUTING_POLICIES,
    SEND_TIMEOUT_S,
    STREAMING_HANDOFF,
    VLLM_HANDOFF,
)

#: environment variable read when ``--api-key`` is not given (keeps the key out of ``ps``)
API_KEY_ENV = "DISAGG_PROXY_API_KEY"
#: the engine key the proxy sends to every engine (``Authorization: Bearer KEY``); ``disagg up``
#: puts the run's key here, and takes it from here instead of generating one when it is set
ENGINE_KEY_ENV = "DISAGG_ENGINE_KEY"

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


def _wait(name: str, default: float, help: str) -> Any:
    """A :class:`ProxyTimeouts` field: ``default`` seconds, flag ``name``."""
    return flag(name, default=default, metavar="S", help=help)


@dataclass(frozen=True)
class ProxyTimeouts:
    """Every wait of the proxy, in seconds (the defaults: :mod:`disagg.serving`, which a topology's
    ``timeouts:`` shares)."""

    connect: float = _wait("--connect-timeout", CONNECT_TIMEOUT_S, "opening a connection to an engine")
    request: float = _wait("--request-timeout", REQUEST_TIMEOUT_S,
                           "longest wait for an engine's reply or the next chunk of its stream")
    health_interval: float = _wait("--health-interval", HEALTH_INTERVAL_S, "between two probe rounds of every engine")
    health_timeout: float = _wait("--health-timeout", HEALTH_TIMEOUT_S, "one GET /health probe")
    drain: float = _wait("--drain-timeout", DRAIN_TIMEOUT_S, "on SIGTERM, how long in-flight requests may finish")
    #: a client's side, as nginx's client_header_timeout, client_body_timeout and send_timeout:
    client_header: float = _wait("--client-header-timeout", CLIENT_HEADER_TIMEOUT_S,
                                 "a client connection's request headers must arrive within S (also: idle keep-alive)")
    client_body: float = _wait("--client-body-timeout", CLIENT_BODY_TIMEOUT_S,
                               "a request's whole body must arrive within S of its headers (else 408)")
    send: float = _wait("--send-timeout", SEND_TIMEOUT_S,
                        "a client that reads nothing of its stream for S is let go, its engine requests aborted")

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


def parse_handoff_options(items: list[str]) -> tuple[tuple[str, str], ...]:
    """``["bootstrap_ports=8998"]`` (``--handoff-option`` words) -> ``(("bootstrap_ports", "8998"),)``;
    raises ProxyError."""
    bad = [item for item in items if "=" not in item or not item.partition("=")[0].strip()]
    if bad:
        raise ProxyError(f"--handoff-option {bad[0]!r}: expected KEY=VALUE")
    return tuple((key.strip(), value.strip()) for key, _, value in (item.partition("=") for item in items))


def parse_roles(text: str) -> tuple[str, ...]:
    """``"prefill,decode"`` (``--route-measured-rates``) -> ``("prefill", "decode")``: roles among
    :data:`SEED_ROLES`; argparse reports an unknown one."""
    roles = tuple(r.strip() for r in text.split(",") if r.strip())
    unknown = [r for r in roles if r not in SEED_ROLES]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown role(s) {', '.join(unknown)}; expected {', '.join(SEED_ROLES)}")
    return roles


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

    policy: str = flag("--routing-policy", default="split", choices=ROUTING_POLICIES,
                       help="per prompt: 'split' always through the KV handoff (default), 'local' decode "
                            "prefills itself, 'auto' the path with the lowest predicted TTFT (needs the "
                            "--route-* seed figures; `disagg up` passes them from the topology)")
    kv_bytes_per_token: float | None = flag("--route-kv-bytes-per-token", default=None, metavar="B",
                                            help="auto: KV cache bytes per token")
    prefill_tokens_per_s: float | None = flag("--route-prefill-rate", default=None, metavar="TOK/S",
                                              help="auto: prefill engines' seed rate")
    #: local prefill on a decode engine (default: prefill's)
    decode_tokens_per_s: float | None = flag("--route-decode-rate", default=None, metavar="TOK/S",
                                             help="auto: decode engines' seed prefill rate (default: the "
                                                  "prefill rate)")
    link_bytes_per_s: float | None = flag("--route-link-rate", default=None, metavar="B/S",
                                          help="auto: seed link rate, bytes per second")
    #: default: disagg.routecost.DEFAULT_HANDOFF_FIXED_S
    handoff_fixed_s: float | None = flag("--route-handoff-fixed", default=None, metavar="S",
                                         help="auto: seed fixed cost of one handoff (default: the largest "
                                              "measured per connector)")
    #: per-request engine cost besides the prompt's tokens
    overhead_s: float = flag("--route-overhead", default=0.0, metavar="S",
                             help="auto: seed per-request engine cost besides the prompt's tokens")
    #: seconds of TTFT one second of stalled decode is worth
    stall_weight: float = flag("--route-stall-weight", default=1.0, metavar="W",
                               help="auto: TTFT seconds one second of stall imposed on each running decode "
                                    "is worth")
    whole: bool = flag("--route-whole", default=False,
                       help="auto: a prefill engine may serve a request alone (without an SLO, while the "
                            "decode side is the bottleneck; with one, wherever the SLO count prefers it)")
    tokenizer: str | None = flag("--tokenizer", default=None, metavar="TOKENIZER.json",
                                 help="the model's tokenizer, for exact prompt lengths")
    chars_per_token: float = flag("--route-chars-per-token", default=4.0, metavar="C",
                                  help="prompt length estimate without --tokenizer (calibrated live)")
    explore_after_s: float = flag("--route-explore-after", default=EXPLORE_AFTER_S, metavar="S",
                                  help="auto: re-measure a path untaken for S seconds ... (default %(default)s)")
    explore_decisions: int = flag("--route-explore-decisions", default=EXPLORE_AFTER_DECISIONS, metavar="N",
                                  help="... and N decisions ... (default %(default)s)")
    explore_within: float = flag("--route-explore-within", default=EXPLORE_WITHIN, metavar="F",
                                 help="... whose score is within F x the best one's (0: never explore; "
                                      "default %(default)s)")
    streaming_layers: int | None = flag("--route-streaming-layers", default=None, metavar="N",
                                        help=f"auto, --handoff {STREAMING_HANDOFF}: the model's layers; a split is "
                                             "predicted with only the part of the KV transfer the streamed "
                                             "prefill does not hide, and splits take no samples of the link "
                                             "(1: priced as if the KV followed the prefill)")
    #: the roles ("prefill", "decode") whose seed rate was measured (``disagg bench``), not estimated
    measured_rates: tuple[str, ...] = flag("--route-measured-rates", default=(), arity="one", parse=parse_roles,
                                           show=",".join, metavar="ROLE[,ROLE]",
                                           help="auto: the roles (prefill, decode) whose seed rate was measured "
                                                "on their hosts, not estimated (`disagg up` passes it)")

    #: the user's SLO: ``auto`` routes for the requests expected to meet it (None: no objective)
    slo_ttft_s: float | None = flag("--route-slo-ttft", default=None, metavar="S",
                                    help="auto: the TTFT objective in seconds; with it (or --route-slo-tpot) "
                                         "each prompt takes the path that maximises the requests expected to "
                                         "meet the SLO")
    slo_tpot_s: float | None = flag("--route-slo-tpot", default=None, metavar="S",
                                    help="auto: the time-per-output-token objective in seconds")

    def __post_init__(self) -> None:
        if self.policy not in ROUTING_POLICIES:
            raise ProxyError(f"routing policy must be one of {', '.join(ROUTING_POLICIES)}, got {self.policy!r}")
        for name in ("kv_bytes_per_token", "prefill_tokens_per_s", "decode_tokens_per_s", "link_bytes_per_s",
                     "handoff_fixed_s", "slo_ttft_s", "slo_tpot_s"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, (int, float)) and value >= 0 and value < float("inf")):
                raise ProxyError(f"routing {name} must be a number >= 0, got {value!r}")
        for name in ("prefill_tokens_per_s", "link_bytes_per_s", "decode_tokens_per_s", "slo_ttft_s", "slo_tpot_s"):
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

    @property
    def slo(self) -> ServiceObjective | None:
        """The SLO ``auto`` routes for (None: none given)."""
        if self.slo_ttft_s is None and self.slo_tpot_s is None:
            return None
        return ServiceObjective(self.slo_ttft_s, self.slo_tpot_s)


@dataclass(frozen=True)
class ProxyConfig:
    """Everything the proxy needs.

    ``prefill`` empty means colocated mode: ``decode`` lists whole servers and
    each request goes whole to one of them (plain load balancing, no handoff).
    """

    decode: tuple[str, ...] = flag("--decode", metavar="URL",
                                   help="decode engine URLs (colocated servers when --prefill is absent)")
    prefill: tuple[str, ...] = flag("--prefill", default=(), metavar="URL", help="prefill engine URLs")
    host: str = flag("--host", default="127.0.0.1", help="address to bind (default: %(default)s)")
    port: int = flag("--port", default=8000, help="port to bind (default: %(default)s; 0 = any free port)")
    handoff: str = flag("--handoff", default=VLLM_HANDOFF, aliases=("--engine",),
                        help="the KV handoff protocol between the engines: vllm (NIXL, the socket connector), "
                             "sglang, vllm-lmcache, vllm-socket-stream (the socket connector streaming the KV "
                             "while prefill computes), vllm-nixl-push (NixlPushConnector: decode registers its "
                             "blocks while prefill computes) (default vllm; --engine is its old name)")
    api_key: str | None = flag("--api-key", default=None, env=API_KEY_ENV,
                               help=f"require 'Authorization: Bearer KEY' on /v1 routes (default: ${API_KEY_ENV} "
                                    "if set)")
    #: sent as ``Authorization: Bearer KEY`` with every request to an engine (``disagg up``
    #: generates one per run and guards the engines with it); like ``api_key``, never in argv
    engine_key: str | None = flag("--engine-key", default=None, repr=False, env=ENGINE_KEY_ENV,
                                  help=f"send 'Authorization: Bearer KEY' with every request to an engine "
                                       f"(default: ${ENGINE_KEY_ENV} if set; prefer the variable, ps shows "
                                       "arguments)")
    fallback: str = flag("--fallback", default="local", choices=FALLBACKS,
                         help="when prefill fails: 'local' lets decode serve alone, 'never' answers 503")
    #: requests served at once; one more is answered 429 with Retry-After
    max_concurrency: int = flag("--max-concurrency", default=DEFAULT_MAX_CONCURRENCY, metavar="N",
                                help="requests served at once; more are answered 429 with Retry-After "
                                     "(default: %(default)s); each prompt of a split batch counts")
    #: prompts in one request; more are answered 400
    max_prompts: int = flag("--max-prompts", default=DEFAULT_MAX_PROMPTS, metavar="N",
                            help="prompts in one request; more are answered 400 (default: %(default)s)")
    #: largest request body in bytes; larger is answered 413
    max_body_bytes: int = flag("--max-body-bytes", default=DEFAULT_MAX_BODY_BYTES, metavar="B",
                               help="largest request body; larger is answered 413 (default: %(default)s)")
    timeouts: ProxyTimeouts = field(default_factory=ProxyTimeouts)
    #: engine-specific handoff settings (``--handoff-option KEY=VALUE``), e.g.
    #: SGLang's ``bootstrap_ports``; each handoff reads the keys it needs
    handoff_options: tuple[tuple[str, str], ...] = flag(
        "--handoff-option", default=(), arity="each", convert=parse_handoff_options, show="=".join,
        metavar="KEY=VALUE",
        help="engine-specific handoff setting, repeatable (sglang: bootstrap_ports=P1,P2 one per --prefill URL; "
             "vllm-socket-stream: kv_peers=H1:P1,H2:P2, each --prefill URL's KV listener)")
    #: the per-prompt routing policy and its seed figures
    routing: RoutingConfig = field(default_factory=RoutingConfig)
    #: ``info`` or ``debug`` (a line per routing decision and per prompt's first token)
    log_level: str = flag("--log-level", default="info", choices=PROXY_LOG_LEVELS,
                          help="debug: also a line per routing decision (every option's predicted TTFT) and per "
                               "prompt's first token (observed against predicted) (default: %(default)s)")

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
        """The ``disagg proxy ...`` arguments (after ``disagg``) that rebuild this config: each
        setting that differs from its default (:func:`disagg.proxy.flags.to_argv`).

        ``with_api_key=False`` leaves both keys (``api_key`` and ``engine_key``)
        out, for a caller that passes them in the environment instead (``ps``
        shows every process's argv).
        """
        return ["proxy", *flags.to_argv(self, keys=with_api_key)]

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser) -> None:
        """Every setting's flag on ``parser`` (``disagg proxy``'s, :mod:`disagg.commands.proxy`)."""
        flags.add_arguments(parser, cls)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ProxyConfig:
        """The config that ``args`` (parsed by a parser :meth:`add_arguments` filled) describes; the
        keys come from their environment variables when their flags are absent."""
        config: ProxyConfig = flags.from_args(cls, args)
        return config
