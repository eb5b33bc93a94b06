"""The topology YAML, validated into frozen dataclasses.

One file describes one deployment: the model, the engine, the KV connector,
the link between hosts, the hosts themselves, the role instances (prefill and
decode, or ``both`` for a colocated baseline) and the proxy in front.  Every
error names ``file:line: field.path: what was expected``; unknown keys are
errors (with a did-you-mean hint), never silently ignored.

See docs/topology.md for the field reference.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path

from disagg_connectors.socket_connector.config import WIRE_FORMATS as _CONNECTOR_WIRE_FORMATS

from disagg.addresses import address_problem
from disagg.errors import ErrorSink, TopologyError
from disagg.hardware import DeviceSpec
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
)
from disagg.yamlsrc import Fields, Node, describe, load_yaml, node_int, parse_yaml

ENGINES = ("vllm", "sglang")
CONNECTORS = ("nixl", "nixl-push", "lmcache", "socket", "mooncake")
#: ``connector.wire_format`` values: the socket connector's (its config owns them)
WIRE_FORMATS: tuple[str, ...] = tuple(_CONNECTOR_WIRE_FORMATS)


def default_streaming(connector: str, engine: str, instances: tuple[InstanceSpec, ...]) -> bool:
    """``connector.streaming`` when the file does not say: whether decode receives each layer's KV
    while prefill is still computing (prefill and decode get the request at once) or fetches it
    after prefill answered. The one place this default is decided.

    On for vLLM with the socket connector when no prefill instance shares a host with a decode
    instance: there the KV crosses a real link, and ``benchmarks/streaming_ttft.py`` measured the
    streamed handoff's TTFT below the fetched one on every shaped row (1 and 2.5 Gb/s, 128-2,048
    tokens; docs/socket-connector.md). Off when they share a host: over loopback the transfer is a
    few percent of the prefill, and sending it while the prefill runs costs that prefill's CPU
    (measured within -5%..+5% of fetching, one row slower)."""
    if connector != "socket" or engine != "vllm":
        return False
    prefill = {i.host for i in instances if i.role == "prefill"}
    decode = {i.host for i in instances if i.role == "decode"}
    return bool(prefill) and bool(decode) and not prefill & decode
LINK_TYPES = ("loopback", "ethernet", "roce", "emulated")
ROLES = ("prefill", "decode", "both")
#: the kinds of device a host runs engines on (the accelerator models for `plan` are disagg.hardware.DEVICES)
DEVICE_KINDS = ("cpu", "cuda")
DTYPES = ("auto", "bfloat16", "float16", "float32")
PROXY_KINDS = ("builtin", "vllm-router", "sglang-router")
EMBEDDED_MODEL_PREFIX = "disagg:"

_RATE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(bit|kbit|mbit|gbit|tbit)\s*$", re.IGNORECASE)
_RATE_UNITS = {"bit": 1.0, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12}


def parse_rate(text: str) -> float:
    """Parse a tc-style rate such as ``2.5gbit`` into bits per second.

    Raises ValueError with a message that says what is expected.
    """
    match = _RATE_RE.match(text)
    if not match or float(match.group(1)) <= 0:
        raise ValueError(f"bad link rate {text!r}: expected a positive number followed by "
                         "bit, kbit, mbit, gbit or tbit, e.g. 2.5gbit")
    return float(match.group(1)) * _RATE_UNITS[match.group(2).lower()]


@dataclass(frozen=True)
class ModelSpec:
    """Which weights every engine serves."""

    source: str                 # as written in the file
    path: str                   # resolved local path, HF id, or the embedded model's path
    embedded: str | None        # name of the embedded model ("tiny"), if any
    dtype: str = "auto"
    max_model_len: int | None = None
    served_name: str | None = None


@dataclass(frozen=True)
class LinkSpec:
    """The network between prefill and decode hosts."""

    type: str
    rate_bps: float | None = None       # nominal (ethernet/roce) or shaped (emulated)
    rate_text: str | None = None
    interface: str | None = None        # NIC name for UCX_NET_DEVICES (a host's own ``interface`` wins)
    #: ``link.ucx_ports``: the TCP ports UCX listens on (UCX_TCP_PORT_RANGE) for every NIXL engine;
    #: None: each engine gets its own range derived from its kv_port (:func:`disagg.kv.ucx.ucx_port_range`)
    ucx_ports: tuple[int, int] | None = None


_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(B|KiB|MiB|GiB|TiB|KB|MB|GB|TB|K|M|G|T)?\s*$")
_SIZE_UNITS = {"B": 1, "K": 2**10, "KiB": 2**10, "M": 2**20, "MiB": 2**20, "G": 2**30, "GiB": 2**30,
               "T": 2**40, "TiB": 2**40, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}


def parse_size(text: str) -> int:
    """Parse a memory size such as ``256MiB``, ``1.5GiB``, ``2GB`` or a plain byte count.

    Raises ValueError with a message that says what is expected.
    """
    match = _SIZE_RE.match(text)
    if not match or float(match.group(1)) <= 0:
        raise ValueError(f"bad size {text!r}: expected a positive number of bytes, optionally followed by "
                         "KiB, MiB, GiB, TiB (powers of 2) or KB, MB, GB, TB (powers of 10), e.g. 256MiB")
    return int(float(match.group(1)) * _SIZE_UNITS[match.group(2) or "B"])


@dataclass(frozen=True)
class EmulationSpec:
    """What a host emulates on this machine (``emulate:``), so a house of unlike boxes runs on one.

    ``prefill_rate``: at most this many prompt tokens/s per engine: each engine step that computes
    prompt tokens is held until they would have taken that long (decode steps are left alone), by the
    plugin ``disagg_connectors.emulated_prefill``. ``kv_memory_bytes``: every engine's KV cache on the
    host (vLLM's ``--kv-cache-memory-bytes``). ``cpu_share``: the host's engines share this many cores
    (a cgroup CPU quota; local hosts only), for a uniformly slower host. Plan and routing never use
    the stated rate: they use what ``disagg bench prefill`` measures on the running engines.
    """

    prefill_rate: float | None = None
    kv_memory_bytes: int | None = None
    cpu_share: float | None = None

    def describe(self) -> str:
        """One line for ``check``, ``status`` and every ``bench`` output."""
        from disagg.units import fmt_bytes
        parts = []
        if self.prefill_rate is not None:
            parts.append(f"prefill at most {self.prefill_rate:,.0f} tokens/s")
        if self.kv_memory_bytes is not None:
            parts.append(f"KV cache {fmt_bytes(self.kv_memory_bytes)} per engine")
        if self.cpu_share is not None:
            parts.append(f"{self.cpu_share:g} CPU cores (cgroup quota)")
        return "emulated: " + ", ".join(parts)


@dataclass(frozen=True)
class HostSpec:
    """One machine: where engines run and how to reach it."""

    name: str
    address: str                        # the host's address on the link
    ssh: str | None = None              # user@host for remote hosts; None = local
    ssh_port: int | None = None
    ssh_key: str | None = None
    ssh_options: tuple[str, ...] = ()   # extra `ssh -o` options, e.g. UserKnownHostsFile=...
    python: str | None = None           # interpreter on that host
    workdir: str | None = None          # remote run directory (logs)
    device: str = "cpu"
    gpu: str | None = None              # accelerator model (disagg.hardware.DEVICES), for plan
    kv_memory_gb: float | None = None   # memory for KV caches on this host, for plan
    #: the accelerator's spec sheet when the topology gives its own (``gpu: {tflops, memory_gb}``)
    gpu_spec: DeviceSpec | None = None
    emulate: EmulationSpec | None = None  # what this host emulates (prefill rate, KV memory, CPU share)
    venv: str | None = None             # the virtual environment ``python`` lives in (``venv:``), for setup
    interface: str | None = None        # this host's NIC for UCX_NET_DEVICES (overrides link.interface)
    model: str | None = None            # this host's copy of the model (overrides model.path on this host)

    @property
    def is_remote(self) -> bool:
        return self.ssh is not None


@dataclass(frozen=True)
class InstanceSpec:
    """One engine process in a role."""

    role: str                           # prefill | decode | both
    index: int
    host: str
    port: int
    kv_port: int | None                 # connector side channel / listener port
    args: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    cpus: tuple[int, ...] = ()
    gpus: tuple[int, ...] = ()
    line: int = 0

    @property
    def name(self) -> str:
        """``prefill[0]``, ``decode[1]``, ``both[0]``."""
        return f"{self.role}[{self.index}]"

    def arg(self, *flags: str) -> str | None:
        """The value given to the first of ``flags`` found in the extra engine ``args``
        (``--flag value`` or ``--flag=value``), or None. The one place that reads them."""
        args = list(self.args)
        for flag in flags:
            for i, a in enumerate(args):
                if a == flag and i + 1 < len(args):
                    return args[i + 1]
                if a.startswith(flag + "="):
                    return a.split("=", 1)[1]
        return None


@dataclass(frozen=True)
class ProxySpec:
    """The OpenAI-compatible front door."""

    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    fallback: str = "local"
    kind: str = "builtin"
    max_concurrency: int | None = None  # requests served at once; more get 429 (None: the proxy's default)
    log_level: str = "info"             # serving.PROXY_LOG_LEVELS
    max_prompts: int | None = None      # prompts in one request; more get 400 (None: the proxy's default)
    max_body_bytes: int | None = None   # largest request body; larger gets 413 (None: the proxy's default)


@dataclass(frozen=True)
class RoutingSpec:
    """How the builtin proxy routes each prompt of a split topology (``routing:``).

    ``policy``: ``auto`` (the default) predicts each prompt's TTFT on every path and
    takes the fastest (:mod:`disagg.routecost`); ``split`` sends every prompt that can
    be split through the KV handoff (the behaviour before ``routing`` existed);
    ``local`` lets the decode engines prefill every prompt themselves.
    ``slo_ttft_s`` / ``slo_tpot_s`` (``slo: {ttft: 500ms, tpot: 25ms}``): the user's SLO;
    ``auto`` then routes each prompt for the requests expected to meet it
    (:mod:`disagg.proxy.policy`).
    """

    policy: str = "auto"
    slo_ttft_s: float | None = None
    slo_tpot_s: float | None = None
    #: ``explore``: re-measure a path untaken for ``after`` seconds and ``decisions`` decisions
    #: whose score is within ``within`` x the best (``explore: off``: within 0, never)
    explore_after_s: float = EXPLORE_AFTER_S
    explore_decisions: int = EXPLORE_AFTER_DECISIONS
    explore_within: float = EXPLORE_WITHIN


@dataclass(frozen=True)
class Timeouts:
    """Every wait in one place, in seconds (the proxy's defaults are :mod:`disagg.serving`'s, which
    ``disagg proxy``'s flags share)."""

    startup: float = 900.0              # engine start until /health is 200
    health_interval: float = HEALTH_INTERVAL_S  # proxy health probes
    shutdown_grace: float = 20.0        # SIGTERM -> SIGKILL
    request: float = REQUEST_TIMEOUT_S  # one upstream request in the proxy
    connect: float = CONNECT_TIMEOUT_S  # opening an upstream connection
    health_timeout: float = HEALTH_TIMEOUT_S  # one proxy health probe
    drain: float = DRAIN_TIMEOUT_S      # proxy SIGTERM: in-flight requests may finish this long
    proxy_startup: float = 60.0         # proxy start until its /health answers
    ssh_command: float = 60.0           # one ssh command that starts a remote engine, writes its files, checks ports
    ssh_check: float = 20.0             # one quick ssh command: is a remote process alive, SIGKILL it, tail its log
    #: a running engine (or the proxy) whose health check has failed for this long, every probe in a
    #: row (at least 2; one every health_interval, each of health_timeout), is killed and restarted
    liveness: float = 30.0
    client_header: float = CLIENT_HEADER_TIMEOUT_S  # proxy: a client's request headers (and an idle keep-alive)
    client_body: float = CLIENT_BODY_TIMEOUT_S  # proxy: a client's whole request body, once its headers are in
    send: float = SEND_TIMEOUT_S        # proxy: one write to a client that stopped reading its stream


#: where state and logs go when the topology does not say (``run_dir``; a remote host's ``workdir``)
DEFAULT_RUN_DIR = ".disagg"

RESTART_POLICIES = ("on-failure", "always", "no")


@dataclass(frozen=True)
class RestartSpec:
    """What ``disagg up`` does when an engine or the proxy exits on its own (systemd's words).

    ``policy``: ``on-failure`` restarts after a non-zero exit or a signal, ``always`` after any
    exit, ``no`` never. At most ``max`` restarts of one process within any ``window`` seconds;
    the next exit is reported as final. The wait before a restart starts at ``backoff`` seconds
    and doubles with each restart in the window, up to ``max_backoff``.
    """

    policy: str = "on-failure"
    max: int = 5
    window: float = 600.0
    backoff: float = 1.0
    max_backoff: float = 30.0


@dataclass(frozen=True)
class Topology:
    """A validated topology file."""

    file: str
    name: str
    model: ModelSpec
    engine: str
    connector: str
    link: LinkSpec
    hosts: dict[str, HostSpec]
    instances: tuple[InstanceSpec, ...]
    proxy: ProxySpec = field(default_factory=ProxySpec)
    timeouts: Timeouts = field(default_factory=Timeouts)
    routing: RoutingSpec = field(default_factory=RoutingSpec)
    run_dir: str = DEFAULT_RUN_DIR
    restart: RestartSpec = field(default_factory=RestartSpec)
    #: how the KV crosses the link: ``raw`` (the cache's bytes) or ``fp8`` (socket connector only)
    wire_format: str = "raw"
    #: socket connector only: decode receives the KV layer by layer while prefill computes
    #: (``connector.streaming``; the proxy then sends both requests at once)
    streaming: bool = False
    #: every field path of the file -> its line (``where``); empty for a topology built in code
    lines: dict[str, int] = field(default_factory=dict, compare=False, repr=False)

    def where(self, path: str) -> int | None:
        """The line of a field path such as ``proxy.kind`` (or of the nearest field above it)."""
        while path:
            if path in self.lines:
                return self.lines[path]
            path = path.rsplit(".", 1)[0] if "." in path else ""
        return None

    def located(self, path: str) -> str:
        """``file:line: path``, the prefix of an error about a field (compatibility errors raised
        after validation: ``disagg.deployment``, the adapters, ``disagg.launch.frontend``)."""
        line = self.where(path)
        return f"{self.file}:{line}: {path}" if line is not None else f"{self.file}: {path}"

    @property
    def colocated(self) -> bool:
        """True when the roles are ``both`` (no KV transfer)."""
        return any(i.role == "both" for i in self.instances)

    def role(self, role: str) -> tuple[InstanceSpec, ...]:
        """The instances of one role, in file order."""
        return tuple(i for i in self.instances if i.role == role)

    def host_of(self, instance: InstanceSpec) -> HostSpec:
        return self.hosts[instance.host]

    def model_path(self, host: HostSpec) -> str:
        """Where engines on ``host`` load the model: the host's ``model``, else ``model.path``."""
        return host.model or self.model.path


def load_topology(path: str | Path, *, run_dir: str | None = None) -> Topology:
    """Read and validate a topology file."""
    return build_topology(load_yaml(path), Path(path), run_dir=run_dir)


def parse_topology(text: str, file: str = "<string>", *, run_dir: str | None = None) -> Topology:
    """Validate topology YAML given as text (``file`` is used in messages)."""
    return build_topology(parse_yaml(text, file), Path(file), run_dir=run_dir)


def build_topology(root: Node, path: Path, *, run_dir: str | None = None) -> Topology:
    """Build a :class:`Topology` from a parsed YAML tree.

    Every error of the file is reported in one run: each section, each host and each instance is
    read on its own and the cross-field checks run on what was read (an :class:`ErrorSink`); one
    error is raised as itself, several as :class:`TopologyErrors`. A section that needs another
    (roles need hosts) is skipped when that one failed."""
    sink = ErrorSink()
    top = Fields(root, "a mapping of topology fields (model, engine, hosts, roles, ...)")
    name = sink.attempt(lambda: _name(top.take("name"), path, root))
    file_run_dir = sink.attempt(lambda: top.str("run_dir", DEFAULT_RUN_DIR)) or DEFAULT_RUN_DIR
    resolved_run_dir = run_dir or file_run_dir
    models_home = run_dir or project_run_dir(file_run_dir, path)
    model = sink.attempt(lambda: _model(top.required("model"), path, models_home))
    engine = sink.attempt(lambda: top.choice("engine", ENGINES, "vllm"))
    given = root.children.get("connector")
    if given is not None and isinstance(given.value, dict):
        conn = sink.attempt(lambda: _connector(top.required("connector")))
    else:
        conn = sink.attempt(lambda: (top.choice("connector", CONNECTORS, "nixl"), "raw", None))
    link = sink.attempt(lambda: _link(top.take("link"), root))
    hosts_node = sink.attempt(lambda: top.required("hosts"))
    hosts = _hosts_each(hosts_node, sink) if hosts_node is not None else None
    roles_node = sink.attempt(lambda: top.required("roles"))
    instances = (sink.attempt(lambda: _roles(roles_node, hosts, sink))
                 if roles_node is not None and hosts is not None else None)
    proxy = sink.attempt(lambda: _proxy(top.take("proxy")))
    timeouts = sink.attempt(lambda: _timeouts(top.take("timeouts")))
    routing = sink.attempt(lambda: _routing(top.take("routing"), engine or "vllm"))
    restart = sink.attempt(lambda: _restart(top.take("restart")))
    sink.attempt(top.done)
    if hosts is not None:
        for host_name, host in hosts.items():
            problem = address_problem(host.address)
            if problem is not None:
                sink.add(TopologyError(str(path), _line(root, f"hosts.{host_name}.address"),
                                       f"hosts.{host_name}.address", problem))
    if proxy is not None and (problem := address_problem(proxy.host)) is not None:
        sink.add(TopologyError(str(path), _line(root, "proxy.host"), "proxy.host", problem))
    sink.raise_if_any()
    assert (name is not None and model is not None and engine is not None and conn is not None
            and link is not None and hosts is not None and instances is not None and proxy is not None
            and timeouts is not None and routing is not None and restart is not None)
    connector, wire_format, streaming_given = conn
    instances = _assign_kv_ports(instances, hosts, proxy)
    streaming = (streaming_given if streaming_given is not None
                 else default_streaming(connector, engine, instances))
    topo = Topology(file=str(path), name=name, model=model, engine=engine, connector=connector,
                    link=link, hosts=hosts, instances=instances, proxy=proxy, timeouts=timeouts, routing=routing,
                    run_dir=resolved_run_dir, restart=restart, wire_format=wire_format,
                    streaming=streaming, lines=_lines(root))
    _check_ports(topo, root, sink)
    sink.attempt(lambda: _check_link(topo, root))
    sink.attempt(lambda: _check_emulate(topo, root))
    sink.raise_if_any()
    return topo


def _hosts_each(node: Node, sink: ErrorSink) -> dict[str, HostSpec] | None:
    """:func:`_hosts`, one host at a time, so that each host's first error is reported; None when
    any failed."""
    if not node.is_mapping or not node.children:
        return sink.attempt(lambda: _hosts(node))
    hosts: dict[str, HostSpec] = {}
    failed = False
    for name, child in node.children.items():
        one = Node({name: child.value}, node.line, node.path, node.file, children={name: child})
        got = sink.attempt(partial(_hosts, one))
        if got is None:
            failed = True
        else:
            hosts.update(got)
    return None if failed else hosts


def _lines(root: Node) -> dict[str, int]:
    """Every field path of the file -> its line (:meth:`Topology.where`)."""
    out: dict[str, int] = {}
    stack = [root]
    while stack:
        node = stack.pop()
        if node.path:
            out[node.path] = node.line
        stack.extend(node.children.values())
        stack.extend(node.items)
    return out


def project_run_dir(run_dir: str, path: Path) -> str:
    """Where a relative ``run_dir`` of the file (``.disagg`` by default) holds the embedded models:
    under the project of the topology file (the nearest directory above it with a ``.git`` or a
    ``pyproject.toml``), so ``disagg:tiny`` means one directory from wherever disagg runs; under
    the current directory when the file is in no project. An absolute ``run_dir`` stays."""
    if Path(run_dir).is_absolute():
        return run_dir
    for directory in Path(path).resolve().parents:
        if (directory / ".git").exists() or (directory / "pyproject.toml").exists():
            return str(directory / run_dir)
    return run_dir


_ENV_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def _name(node: Node | None, path: Path, root: Node) -> str:
    """The topology's name: a directory name under ``<run_dir>/runs/``, so it must stay in one."""
    if node is None:
        name, where, origin = path.stem, root, f" (the file name {path.name!r} without .yaml; set name:)"
    else:
        if isinstance(node.value, (dict, list, bool)):
            raise node.error(f"expected a string, got {describe(node.value)}")
        name, where, origin = str(node.value), node, ""
    problem = None
    if not name.strip():
        problem = "is empty"
    elif "/" in name or "\\" in name:
        problem = "contains a path separator (/ or \\)"
    elif ".." in name or name == ".":
        problem = "is '.'" if name == "." else "contains '..'"
    elif not name.isprintable():
        problem = "contains a control or other non-printable character"
    if problem is not None:
        raise TopologyError(where.file, where.line, "name",
                            f"{name!r} {problem}{origin}; the name is the run directory "
                            "<run_dir>/runs/<name>/, so it must be one plain directory name")
    return name


def _ssh_destination(node: Node | None) -> str | None:
    """``ssh: [user@]host``: no leading ``-`` (ssh would read it as an option), no whitespace or control characters."""
    if node is None:
        return None
    if isinstance(node.value, (dict, list, bool)):
        raise node.error(f"expected [user@]host, got {describe(node.value)}")
    dest = str(node.value)
    if not dest:
        raise node.error("is empty; expected [user@]host")
    if dest.startswith("-"):
        raise node.error(f"{dest!r} starts with '-', which ssh would read as an option; expected [user@]host")
    if any(ch.isspace() or not ch.isprintable() for ch in dest):
        raise node.error(f"{dest!r} contains whitespace or a control character; expected [user@]host")
    return dest


def _env(node: Node | None) -> dict[str, str]:
    """``env: {NAME: value}``: names are identifiers, values one line each."""
    if node is None:
        return {}
    if not node.is_mapping:
        raise node.error(f"expected a mapping of variable names to strings, got {describe(node.value)}")
    out = {}
    for name, item in node.children.items():
        if not _ENV_NAME_RE.fullmatch(name):
            raise item.error(f"{name!r} is not a variable name (letters, digits and _, not starting with a digit)")
        if isinstance(item.value, (dict, list)) or item.value is None:
            raise item.error(f"expected a string, got {describe(item.value)}")
        value = item.value
        text = ("true" if value else "false") if isinstance(value, bool) else str(value)
        if any(ch in text for ch in "\n\r\0"):
            raise item.error("the value spans lines or holds a NUL character; environment values are one line")
        out[name] = text
    return out


def _model(node: Node, path: Path, run_dir: str) -> ModelSpec:
    if isinstance(node.value, str):
        source, dtype, max_len, served = node.value, "auto", None, None
    else:
        f = Fields(node, "a model path/id or a mapping with path, dtype, max_model_len")
        source = f.str("path", required=True) or ""
        dtype = f.choice("dtype", DTYPES, "auto")
        max_len = f.int("max_model_len", minimum=16)
        served = f.str("served_name")
        f.done()
    embedded = None
    if source.startswith(EMBEDDED_MODEL_PREFIX):
        embedded = source[len(EMBEDDED_MODEL_PREFIX):]
        from disagg.modelgen import EMBEDDED_MODELS  # light import, no torch
        if embedded not in EMBEDDED_MODELS:
            raise node.error(f"unknown embedded model {source!r}; expected one of "
                             + ", ".join(EMBEDDED_MODEL_PREFIX + m for m in EMBEDDED_MODELS),
                             path=node.path if isinstance(node.value, str) else "model.path")
        resolved = str(Path(run_dir).resolve() / "models" / embedded)
    elif source.startswith(("/", "./", "../", "~")) or (path.parent / source).exists():
        resolved = str((path.parent / Path(source).expanduser()).resolve())
    else:
        resolved = source  # a Hugging Face id, resolved by the engine
    return ModelSpec(source=source, path=resolved, embedded=embedded, dtype=dtype,
                     max_model_len=max_len, served_name=served)


def _connector(node: Node) -> tuple[str, str, bool | None]:
    """``connector: {type: NAME, wire_format: raw|fp8, streaming: true|false}``: (name, wire format,
    streaming, None when not given: :func:`default_streaming`). The plain ``connector: NAME`` form is
    an ordinary choice (:func:`build_topology`)."""
    f = Fields(node, f"a connector name ({', '.join(CONNECTORS)}) or a mapping with type, wire_format "
                     "and streaming")
    name = f.choice("type", CONNECTORS, "nixl")
    wire = f.choice("wire_format", WIRE_FORMATS, "raw")
    streaming_node = node.children.get("streaming")
    given = streaming_node is not None and streaming_node.value is not None
    streaming = f.bool("streaming", False) if given else None
    if not given:
        f.take("streaming")
    f.done()
    if wire != "raw" and name != "socket":
        raise node.children["wire_format"].error(
            f"wire_format {wire} needs connector type socket (connector {name} sends the cache's own bytes)")
    if streaming_node is not None and given and name != "socket":
        raise streaming_node.error(f"streaming needs connector type socket (it is how our socket connector "
                                   f"hands the KV over; connector {name} has no such setting)")
    return name, wire, streaming


def _link(node: Node | None, root: Node) -> LinkSpec:
    if node is None:
        return LinkSpec(type="loopback")
    if isinstance(node.value, str):
        node = Node({"type": node.value}, node.line, node.path, node.file,
                    children={"type": Node(node.value, node.line, node.path + ".type", node.file)})
    f = Fields(node, "a mapping with type (loopback, ethernet, roce, emulated) and rate")
    link_type = f.choice("type", LINK_TYPES, "loopback")
    rate_node = f.take("rate")
    interface = f.str("interface")
    ucx_node = f.take("ucx_ports")
    f.done()
    ucx_ports = _port_range(ucx_node) if ucx_node is not None else None
    rate_bps = rate_text = None
    if rate_node is not None:
        rate_text = str(rate_node.value)
        try:
            rate_bps = parse_rate(rate_text)
        except ValueError as exc:
            raise rate_node.error(str(exc)) from exc
    if link_type == "emulated" and rate_bps is None:
        raise node.error("an emulated link needs a rate, e.g. rate: 1gbit", path="link.rate")
    if link_type == "loopback" and rate_node is not None:
        raise rate_node.error("a loopback link has no rate; use type: emulated to shape it")
    return LinkSpec(type=link_type, rate_bps=rate_bps, rate_text=rate_text, interface=interface,
                    ucx_ports=ucx_ports)


def _port_range(node: Node) -> tuple[int, int]:
    """``LO-HI``: an inclusive range of TCP ports (``link.ucx_ports``)."""
    match = re.fullmatch(r"\s*(\d+)\s*-\s*(\d+)\s*", str(node.value)) if isinstance(node.value, str) else None
    if match is None:
        raise node.error(f"expected a port range LO-HI such as 41000-41099, got {describe(node.value)}")
    lo, hi = int(match.group(1)), int(match.group(2))
    if not 1024 <= lo <= hi <= 65535:
        raise node.error(f"{lo}-{hi} is not a range of ports between 1024 and 65535 (low end first)")
    return lo, hi


def _host_model(node: Node | None, remote: bool) -> str | None:
    """A host's ``model``: an absolute path on that host (a remote path cannot be resolved here)."""
    if node is None:
        return None
    if isinstance(node.value, (dict, list, bool)) or not str(node.value).strip():
        raise node.error(f"expected the model's directory on this host, got {describe(node.value)}")
    path = str(node.value)
    if not path.startswith("/"):
        raise node.error(f"{path!r} is not absolute; a host's model is a directory on that host, "
                         "e.g. /data/models/qwen" + ("" if remote else " (or leave it out: model.path)"))
    return path


def _hosts(node: Node) -> dict[str, HostSpec]:
    f = Fields(node, "a mapping of host names to {address: ...}")
    hosts = {}
    for name, child in node.children.items():
        f.take(name)
        h = Fields(child, "a mapping with address (and ssh for remote hosts)")
        address = h.str("address", required=True) or ""
        ssh = _ssh_destination(h.take("ssh"))
        ssh_port = h.int("ssh_port", minimum=1, maximum=65535)
        ssh_key = h.str("ssh_key")
        ssh_options = h.str_list("ssh_options")
        python = h.str("python")
        venv = h.take("venv")
        workdir = h.str("workdir")
        device = h.choice("device", DEVICE_KINDS, "cpu")
        gpu, gpu_spec = _gpu(h.take("gpu"), device)
        kv_memory_gb = h.float("kv_memory_gb")
        emulate = _emulate(h.take("emulate"), ssh is not None)
        interface = h.str("interface")
        host_model = _host_model(h.take("model"), ssh is not None)
        h.done()
        if venv is not None:
            if python is not None:
                raise venv.error("give either python or venv, not both")
            python = str(Path(str(venv.value)) / "bin" / "python")
        venv_path = str(venv.value) if venv is not None else None
        if ssh is None and (ssh_port or ssh_key or ssh_options):
            raise child.error("ssh_port/ssh_key/ssh_options need ssh: user@host", path=f"hosts.{name}.ssh")
        hosts[name] = HostSpec(name=name, address=address, ssh=ssh, ssh_port=ssh_port, ssh_key=ssh_key,
                               ssh_options=ssh_options, python=python, workdir=workdir, device=device,
                               gpu=gpu, gpu_spec=gpu_spec, kv_memory_gb=kv_memory_gb, emulate=emulate,
                               venv=venv_path, interface=interface, model=host_model)
    if not hosts:
        raise node.error("at least one host is required")
    return hosts


def _emulate(node: Node | None, remote: bool) -> EmulationSpec | None:
    """A host's ``emulate: {prefill_rate, kv_memory, cpu_share}``, validated (at least one given)."""
    if node is None:
        return None
    f = Fields(node, "a mapping with prefill_rate (tokens/s), kv_memory (e.g. 256MiB) and/or cpu_share (cores)")
    prefill_rate = f.float("prefill_rate")
    memory_node = f.take("kv_memory")
    share_node = f.take("cpu_share")
    f.done()
    kv_memory_bytes = None
    if memory_node is not None:
        try:
            kv_memory_bytes = parse_size(str(memory_node.value))
        except ValueError as exc:
            raise memory_node.error(str(exc)) from exc
        if kv_memory_bytes < 2**20:
            raise memory_node.error(f"{memory_node.value} is under 1 MiB: too small for any KV cache")
    cpu_share = None
    if share_node is not None:
        value = share_node.value
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.01 <= value <= 1024:
            raise share_node.error(f"expected a number of CPU cores between 0.01 and 1024, got {value!r}")
        if remote:
            raise share_node.error("cpu_share is set with a local cgroup: it needs a local host (no ssh)")
        cpu_share = float(value)
    if prefill_rate is None and kv_memory_bytes is None and cpu_share is None:
        raise node.error("emulate needs at least one of prefill_rate, kv_memory, cpu_share")
    return EmulationSpec(prefill_rate=prefill_rate, kv_memory_bytes=kv_memory_bytes, cpu_share=cpu_share)


def _gpu(node: Node | None, device: str) -> tuple[str | None, DeviceSpec | None]:
    """A host's ``gpu``, validated: a known name or alias (see disagg/hardware.py; a bare number
    such as ``4090`` too), or a spec sheet of its own, ``{tflops, memory_gb, memory_bw_gbs, name}``
    (tflops and memory_gb required). Returns the canonical name, and the spec when given inline."""
    if node is None:
        return None, None
    from disagg.hardware import DEVICES as SPECS
    from disagg.hardware import device_names, lookup_device
    custom: DeviceSpec | None = None
    if node.is_mapping:
        f = Fields(node, "a GPU name, or a mapping with tflops, memory_gb, memory_bw_gbs (and a name)")
        tflops, memory_gb = f.float("tflops"), f.float("memory_gb")
        bandwidth, label = f.float("memory_bw_gbs"), f.str("name")
        f.done()
        if tflops is None or memory_gb is None:
            raise node.error("a GPU's own spec sheet needs tflops (dense BF16, TFLOP/s) and memory_gb")
        name = label or "custom"
        custom = DeviceSpec(name, f"{name} ({tflops:g} TFLOP/s, {memory_gb:g} GB)", tflops, memory_gb,
                            "the topology's own figures", memory_gbps=bandwidth)
    else:
        value = node.value
        text = str(value) if isinstance(value, str) or (isinstance(value, int) and not isinstance(value, bool)) \
            else None
        spec = lookup_device(text) if text is not None else None
        if spec is None or spec.name == "cpu":
            from disagg.yamlsrc import did_you_mean
            names = [n for n in SPECS if n != "cpu"]
            raise node.error(f"unknown GPU {value!r}; expected one of {', '.join(names)}, or a mapping "
                             "{tflops: T, memory_gb: M, memory_bw_gbs: B}"
                             + did_you_mean(str(value), [n for n in device_names() if n != "cpu"]))
        name = spec.name
    if device != "cuda":
        raise node.error("names a GPU but the host has device: cpu; add device: cuda")
    return name, custom


def _parse_cpus(node: Node) -> tuple[int, ...]:
    """``[0, 1]``, ``3`` or ``"0-3,6"`` -> a tuple of CPU ids."""
    if node.is_sequence:
        return tuple(node_int(item, minimum=0) for item in node.items)
    if isinstance(node.value, int) and not isinstance(node.value, bool):
        return (node_int(node, minimum=0),)
    text = str(node.value)
    cpus: list[int] = []
    for part in text.split(","):
        m = re.fullmatch(r"\s*(\d+)\s*(?:-\s*(\d+)\s*)?", part)
        if not m or (m.group(2) and int(m.group(2)) < int(m.group(1))):
            raise node.error(f"expected CPU ids such as [0, 1] or \"0-3\", got {text!r}")
        lo, hi = int(m.group(1)), int(m.group(2) or m.group(1))
        cpus.extend(range(lo, hi + 1))
    return tuple(cpus)


def _roles(node: Node, hosts: dict[str, HostSpec], sink: ErrorSink | None = None) -> tuple[InstanceSpec, ...]:
    """Every role instance; with a ``sink``, each instance's error is collected there and the rest
    are still read (the first one is then raised once all were read)."""
    f = Fields(node, "a mapping with prefill and decode (or both) lists")
    instances: list[InstanceSpec] = []
    present = {}
    for role in ROLES:
        child = f.take(role)
        if child is None:
            continue
        if not child.is_sequence or not child.items:
            raise child.error("expected a non-empty list of instances, e.g. [{host: a, port: 8100}]")
        present[role] = child
        for index, item in enumerate(child.items):
            if sink is None:
                instances.append(_instance(item, role, index, hosts))
            elif (inst := sink.attempt(partial(_instance, item, role, index, hosts))) is not None:
                instances.append(inst)
    f.done()
    if sink is not None and len(instances) < sum(len(c.items) for c in present.values()):
        raise sink.errors.pop()  # already collected: the instances are incomplete
    if "both" in present:
        other = next((present[r] for r in ("prefill", "decode") if r in present), None)
        if other is not None:
            raise other.error("a colocated topology (roles.both) cannot also have prefill or decode roles")
    else:
        for role in ("prefill", "decode"):
            if role not in present:
                raise TopologyError(node.file, node.line, f"roles.{role}",
                                    "is missing: a disaggregated topology needs prefill and decode "
                                    "instances (or a single 'both' list for a colocated one)")
    return tuple(instances)


def _instance(node: Node, role: str, index: int, hosts: dict[str, HostSpec]) -> InstanceSpec:
    f = Fields(node, "a mapping with host and port")
    host_node = f.take("host")
    if host_node is None:
        if len(hosts) != 1:
            raise node.error("is required when the topology has more than one host",
                             path=f"{node.path}.host")
        host = next(iter(hosts))
    else:
        host = str(host_node.value)
        if host not in hosts:
            from disagg.yamlsrc import did_you_mean
            raise host_node.error(f"unknown host {host!r}; hosts are {', '.join(hosts)}"
                                  + did_you_mean(host, hosts))
    port = f.int("port", required=True, minimum=1, maximum=65535)
    kv_port = f.int("kv_port", minimum=1, maximum=65535)
    args = f.str_list("args")
    env = _env(f.take("env"))
    cpus_node = f.take("cpus")
    gpus_node = f.take("gpus")
    f.done()
    cpus = _parse_cpus(cpus_node) if cpus_node is not None else ()
    gpus = _parse_cpus(gpus_node) if gpus_node is not None else ()
    if gpus_node is not None and gpus and hosts[host].device != "cuda":
        raise gpus_node.error(f"host {host!r} has device: cpu; set device: cuda to use gpus")
    return InstanceSpec(role=role, index=index, host=host, port=port or 0, kv_port=kv_port,
                        args=args, env=tuple(env.items()), cpus=cpus, gpus=gpus, line=node.line)


def _proxy(node: Node | None) -> ProxySpec:
    if node is None:
        return ProxySpec()
    f = Fields(node, "a mapping with host, port, api_key, fallback, max_concurrency, max_prompts, max_body_bytes, "
                     "log_level")
    spec = ProxySpec(host=f.str("host", "127.0.0.1") or "127.0.0.1",
                     port=f.int("port", 8000, minimum=1, maximum=65535) or 8000,
                     api_key=f.str("api_key"),
                     fallback=f.choice("fallback", FALLBACKS, "local"),
                     kind=f.choice("kind", PROXY_KINDS, "builtin"),
                     max_concurrency=f.int("max_concurrency", minimum=1),
                     max_prompts=f.int("max_prompts", minimum=1),
                     max_body_bytes=f.int("max_body_bytes", minimum=1),
                     log_level=f.choice("log_level", PROXY_LOG_LEVELS, "info"))
    f.done()
    return spec


def _routing(node: Node | None, engine: str) -> RoutingSpec:
    if node is None:
        return RoutingSpec()
    f = Fields(node, "a mapping with policy (auto, split, local), explore and slo")
    policy_node = f.take("policy")
    explore_node = f.take("explore")
    slo_node = f.take("slo")
    f.done()
    policy = "auto" if policy_node is None else policy_node.value
    if policy not in ROUTING_POLICIES:
        assert policy_node is not None
        raise policy_node.error(f"expected one of {', '.join(ROUTING_POLICIES)}, got {describe(policy)}")
    if policy == "local" and engine == "sglang":
        assert policy_node is not None
        raise policy_node.error("engine sglang cannot prefill on its decode servers; use auto or split")
    spec = _slo(slo_node, RoutingSpec(policy=str(policy)))
    if slo_node is not None and policy != "auto":
        raise slo_node.error(f"an SLO steers only the auto policy; this topology's routing policy is {policy}")
    return _explore(explore_node, spec)


def _slo(node: Node | None, spec: RoutingSpec) -> RoutingSpec:
    """``spec`` with ``routing.slo``: ``{ttft: 500ms, tpot: 25ms}`` (at least one of the two)."""
    if node is None:
        return spec
    f = Fields(node, "a mapping with ttft and/or tpot (durations, e.g. 500ms)")
    ttft, tpot = f.take("ttft"), f.take("tpot")
    f.done()
    if ttft is None and tpot is None:
        raise node.error("expected ttft and/or tpot (durations, e.g. {ttft: 500ms, tpot: 25ms})")
    return replace(spec, slo_ttft_s=_duration(ttft) if ttft is not None else None,
                   slo_tpot_s=_duration(tpot) if tpot is not None else None)


def _explore(node: Node | None, spec: RoutingSpec) -> RoutingSpec:
    """``spec`` with ``routing.explore``: ``{after: 60s, decisions: 50, within: 2}`` (each optional)
    or ``off``."""
    if node is None:
        return spec
    if node.value is False or node.value == "off":
        return replace(spec, explore_within=0.0)
    f = Fields(node, "off, or a mapping with after (a duration), decisions, within")
    after = f.take("after")
    spec = replace(spec, explore_after_s=_duration(after) if after is not None else spec.explore_after_s,
                   explore_decisions=f.int("decisions", spec.explore_decisions, minimum=1) or spec.explore_decisions,
                   explore_within=f.float("within", spec.explore_within, above=1.0) or spec.explore_within)
    f.done()
    return spec


def _timeouts(node: Node | None) -> Timeouts:
    if node is None:
        return Timeouts()
    f = Fields(node, "a mapping of timeouts in seconds")
    d = Timeouts()
    durations = {key: _duration(child) for key in ("ssh_command", "ssh_check", "liveness")
                 if (child := f.take(key)) is not None}
    t = Timeouts(startup=f.float("startup", d.startup) or d.startup,
                 health_interval=f.float("health_interval", d.health_interval) or d.health_interval,
                 shutdown_grace=f.float("shutdown_grace", d.shutdown_grace) or d.shutdown_grace,
                 request=f.float("request", d.request) or d.request,
                 connect=f.float("connect", d.connect) or d.connect,
                 health_timeout=f.float("health_timeout", d.health_timeout) or d.health_timeout,
                 drain=f.float("drain", d.drain) or d.drain,
                 proxy_startup=f.float("proxy_startup", d.proxy_startup) or d.proxy_startup,
                 client_header=f.float("client_header", d.client_header) or d.client_header,
                 client_body=f.float("client_body", d.client_body) or d.client_body,
                 send=f.float("send", d.send) or d.send,
                 ssh_command=durations.get("ssh_command", d.ssh_command),
                 ssh_check=durations.get("ssh_check", d.ssh_check), liveness=durations.get("liveness", d.liveness))
    f.done()
    return t


_DURATION_RE = re.compile(r"\s*([0-9]+(?:\.[0-9]*)?)\s*(ms|s|m|h)?\s*")
_DURATION_UNITS = {"ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0, None: 1.0}


def _duration(node: Node) -> float:
    """A positive duration: a number of seconds or a string such as ``500ms``, ``30s``, ``10m``, ``1h``."""
    value = node.value
    if isinstance(value, bool):
        raise node.error(f"expected a duration (seconds, or e.g. 30s, 10m), got {describe(value)}")
    match = _DURATION_RE.fullmatch(value) if isinstance(value, str) else None
    if isinstance(value, (int, float)):
        seconds = float(value)
    elif match is not None:
        seconds = float(match.group(1)) * _DURATION_UNITS[match.group(2)]
    else:
        raise node.error(f"expected a duration (seconds, or e.g. 30s, 10m), got {describe(value)}")
    if not 0 < seconds < 1e7:
        raise node.error(f"expected a duration greater than 0 and below 1e7 s, got {value!r}")
    return seconds


def _restart(node: Node | None) -> RestartSpec:
    if node is None:
        return RestartSpec()
    f = Fields(node, "a mapping with policy, max, window, backoff, max_backoff")
    d = RestartSpec()
    durations = {key: _duration(child) for key in ("window", "backoff", "max_backoff")
                 if (child := f.take(key)) is not None}
    spec = RestartSpec(policy=f.choice("policy", RESTART_POLICIES, d.policy),
                       max=f.int("max", d.max, minimum=0, maximum=1000) or 0,
                       window=durations.get("window", d.window), backoff=durations.get("backoff", d.backoff),
                       max_backoff=durations.get("max_backoff", max(d.max_backoff, durations.get("backoff", 0.0))))
    f.done()
    if spec.max_backoff < spec.backoff:
        raise node.error(f"max_backoff ({spec.max_backoff:g} s) is shorter than backoff ({spec.backoff:g} s)")
    return spec


KV_PORT_BASE = 5600


def _assign_kv_ports(instances: tuple[InstanceSpec, ...], hosts: dict[str, HostSpec],
                     proxy: ProxySpec) -> tuple[InstanceSpec, ...]:
    """Give each disaggregated instance without ``kv_port`` the next free port from 5600."""
    taken = {(hosts[i.host].address, p) for i in instances for p in (i.port, i.kv_port) if p}
    taken.add((proxy.host, proxy.port))
    out = []
    for inst in instances:
        if inst.role != "both" and inst.kv_port is None:
            address = hosts[inst.host].address
            port = KV_PORT_BASE
            while (address, port) in taken:
                port += 1
            taken.add((address, port))
            inst = replace(inst, kv_port=port)
        out.append(inst)
    return tuple(out)


def _find(root: Node, path: str) -> Node | None:
    """The node at a dotted path such as ``roles.decode[0].port``."""
    node: Node | None = root
    for part in re.findall(r"[^.\[\]]+|\[\d+\]", path):
        if node is None:
            return None
        if part.startswith("["):
            idx = int(part[1:-1])
            node = node.items[idx] if idx < len(node.items) else None
        else:
            node = node.children.get(part)
    return node


def _line(root: Node, path: str) -> int:
    node = _find(root, path)
    return node.line if node is not None else root.line


def iter_ports(topo: Topology) -> Iterator[tuple[str, int, str]]:
    """Every (address, port, field path) the deployment will bind, in file order."""
    for inst in topo.instances:
        address = topo.hosts[inst.host].address
        yield address, inst.port, f"roles.{inst.name}.port"
        if inst.kv_port is not None:
            yield address, inst.kv_port, f"roles.{inst.name}.kv_port"
    yield topo.proxy.host, topo.proxy.port, "proxy.port"


#: bind addresses that mean every address of the host
WILDCARD_ADDRESSES = ("0.0.0.0", "::", "")


def same_place(a: str, b: str) -> bool:
    """Whether listeners on addresses ``a`` and ``b`` of one port would clash."""
    return a == b or a in WILDCARD_ADDRESSES or b in WILDCARD_ADDRESSES


def _check_ports(topo: Topology, root: Node, sink: ErrorSink) -> None:
    """Every port two listeners of the deployment would share, each reported once."""
    seen: list[tuple[str, int, str]] = []
    for address, port, where in iter_ports(topo):
        for other_addr, other_port, other_where in seen:
            if port == other_port and same_place(address, other_addr):
                sink.add(TopologyError(topo.file, _line(root, where), where,
                                    f"{port} is already used by {other_where.rsplit('.', 1)[0]}"
                                    + ("" if other_where.endswith(".port") and where.endswith(".port")
                                       else f" ({other_where})")))
                break
        seen.append((address, port, where))


def _check_link(topo: Topology, root: Node) -> None:
    if topo.link.type == "emulated":
        _check_emulated(topo, root)
        return
    if topo.colocated:
        return
    addresses = {topo.hosts[i.host].address for i in topo.instances}
    if topo.link.type != "loopback" or len(addresses) <= 1:
        return
    if not all(a.startswith("127.") or a in ("localhost", "::1") for a in addresses):
        raise TopologyError(topo.file, _line(root, "link"), "link.type",
                            "loopback, but the prefill and decode hosts have different non-loopback "
                            "addresses; use ethernet, roce or emulated")


#: what ``emulate.kv_memory`` sets, and so what an instance of that host may not set again
KV_MEMORY_FLAG = "--kv-cache-memory-bytes"
KV_MEMORY_ENV = "VLLM_CPU_KVCACHE_SPACE"


def _check_emulate(topo: Topology, root: Node) -> None:
    """Emulated hardware needs vLLM (its plugin and KV flag), and an instance may not size its KV
    cache again on a host whose ``emulate.kv_memory`` does."""
    for name, host in topo.hosts.items():
        if host.emulate is None:
            continue
        if topo.engine != "vllm":
            raise TopologyError(topo.file, _line(root, f"hosts.{name}.emulate"), f"hosts.{name}.emulate",
                                f"emulated hardware works with engine vllm (its plugin and flags), not {topo.engine}")
        if host.emulate.kv_memory_bytes is None:
            continue
        for inst in topo.instances:
            if inst.host != name:
                continue
            where = f"roles.{inst.role}[{inst.index}]"
            if inst.arg(KV_MEMORY_FLAG) is not None:
                raise TopologyError(topo.file, inst.line or None, f"{where}.args",
                                    f"{KV_MEMORY_FLAG} is set by hosts.{name}.emulate.kv_memory; give it once")
            if KV_MEMORY_ENV in dict(inst.env):
                raise TopologyError(topo.file, inst.line or None, f"{where}.env",
                                    f"{KV_MEMORY_ENV} would override hosts.{name}.emulate.kv_memory "
                                    "(vLLM's CPU platform prefers it); give one of them")


EMULATION_NETWORK = ipaddress.ip_network("198.18.0.0/15")


def _check_emulated(topo: Topology, root: Node) -> None:
    """An emulated link joins one local prefill host and one local decode host in one /30 of 198.18.0.0/15."""
    def fail(path: str, message: str) -> TopologyError:
        return TopologyError(topo.file, _line(root, path), path, message)

    if topo.colocated:
        raise fail("link.type", "emulated links shape the KV path between prefill and decode; "
                                "a colocated topology (roles.both) has none")
    sides = {}
    for role in ("prefill", "decode"):
        names = {i.host for i in topo.role(role)}
        if len(names) != 1:
            raise fail(f"roles.{role}", f"with an emulated link all {role} instances run on one host")
        sides[role] = names.pop()
    if sides["prefill"] == sides["decode"]:
        raise fail("roles.decode[0].host", "with an emulated link prefill and decode need different hosts")
    nets = []
    for name in sides.values():
        host = topo.hosts[name]
        if host.is_remote:
            raise fail(f"hosts.{name}.ssh", "emulated links run both hosts on this machine; remove ssh")
        try:
            addr = ipaddress.ip_address(host.address)
        except ValueError:
            addr = None
        if addr is None or addr not in EMULATION_NETWORK:
            raise fail(f"hosts.{name}.address", f"{host.address} is not in 198.18.0.0/15 "
                                                "(the range emulated links use, e.g. 198.18.10.1 and 198.18.10.2)")
        nets.append(ipaddress.ip_network(f"{addr}/30", strict=False))
        if int(addr) in (int(nets[-1].network_address), int(nets[-1].broadcast_address)):
            raise fail(f"hosts.{name}.address", f"{host.address} is the network or broadcast address of its /30")
    if nets[0] != nets[1] or topo.hosts[sides["prefill"]].address == topo.hosts[sides["decode"]].address:
        raise fail(f"hosts.{sides['decode']}.address",
                   "the prefill and decode hosts of an emulated link need two addresses in one /30, "
                   "e.g. 198.18.10.1 and 198.18.10.2")
