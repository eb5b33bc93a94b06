"""Backend pools: pick an engine, count what it is doing, take it out when it
fails its health probe and put it back when it passes again."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager

import aiohttp

from disagg.prometheus_text import sample_label
from disagg.proxy.errors import CLIENT_ERRORS
from disagg.proxy.metrics import ProxyMetrics

log = logging.getLogger("disagg.proxy")

NOT_PROBED = "not probed yet"
#: consecutive uncertain probe failures (timed out, or the connection dropped without an answer)
#: that take a backend out of service, idle or busy: a one-core engine busy with a long prefill,
#: or with serving a large KV cache over a slow link, and an idle one on a loaded machine, can
#: miss one probe's deadline while working normally. A refused connection or an error status is
#: certain and takes it out at once.
TIMEOUT_STRIKES = 2


class Backend:
    """One engine server: its URL, health and outstanding requests."""

    __slots__ = ("healthy", "kv_capacity_tokens", "last_error", "outstanding", "returns", "role", "strikes", "url",
                 "was_in_service")

    def __init__(self, role: str, url: str) -> None:
        self.role = role
        self.url = url
        self.healthy = False          # until the first probe passes
        self.outstanding = 0
        self.last_error: str | None = NOT_PROBED
        self.was_in_service = False   # it was in service at least once (a later return is a new process)
        #: times it came back into service after being taken out (a restart, an outage)
        self.returns = 0
        #: health probes in a row that failed without certainty (timed out, connection dropped);
        #: reset by any answer and by a refused connection
        self.strikes = 0
        #: tokens its KV cache holds (``vllm:cache_config_info``: blocks x block size), read by the
        #: :class:`HealthProber` each time it comes into service; None: not known
        self.kv_capacity_tokens: float | None = None

    def __repr__(self) -> str:
        state = "healthy" if self.healthy else f"unhealthy: {self.last_error}"
        return f"{self.role} {self.url} ({state}, {self.outstanding} in flight)"


class BackendPool:
    """The instances of one role.

    :meth:`pick` chooses the healthy backend with the fewest outstanding
    requests; ties go round-robin. :meth:`lease` counts a request on a backend
    for as long as the caller uses it.

    A backend that comes back into service after it was taken out may be a new
    process (``disagg up`` restarts engines that exit): whatever was measured
    about it no longer holds. Owners of per-backend measurements register with
    :meth:`on_return` and are called, in the event loop, each time that happens.
    """

    def __init__(self, role: str, urls: Sequence[str], metrics: ProxyMetrics) -> None:
        self.role = role
        self.backends = tuple(Backend(role, url) for url in urls)
        self._metrics = metrics
        self._next = 0
        self._returned: list[Callable[[Backend], None]] = []
        for b in self.backends:
            metrics.healthy.labels(role, b.url).set(0)
            metrics.in_flight.labels(role, b.url).set(0)

    def __len__(self) -> int:
        return len(self.backends)

    def healthy(self) -> list[Backend]:
        """The backends currently in service."""
        return [b for b in self.backends if b.healthy]

    def pick(self, exclude: Iterable[Backend] = ()) -> Backend | None:
        """The least loaded healthy backend not in ``exclude`` (round-robin among ties), or None."""
        excluded = set(map(id, exclude))
        n = len(self.backends)
        best: Backend | None = None
        start = self._next
        for i in range(n):
            b = self.backends[(start + i) % n]
            if b.healthy and id(b) not in excluded and (best is None or b.outstanding < best.outstanding):
                best = b
        if best is not None:
            self._next = (self.backends.index(best) + 1) % n
        return best

    @contextmanager
    def lease(self, backend: Backend) -> Iterator[Backend]:
        """Count one request on ``backend`` while the ``with`` block runs."""
        gauge = self._metrics.in_flight.labels(self.role, backend.url)
        backend.outstanding += 1
        gauge.inc()
        try:
            yield backend
        finally:
            backend.outstanding -= 1
            gauge.dec()

    def mark_down(self, backend: Backend, reason: str) -> None:
        """Take ``backend`` out of service until a probe passes."""
        if backend.healthy:
            log.warning("%s %s taken out: %s", self.role, backend.url, reason)
        elif backend.last_error == NOT_PROBED:
            log.warning("%s %s not healthy at start: %s", self.role, backend.url, reason)
        backend.healthy = False
        backend.last_error = reason
        self._metrics.healthy.labels(self.role, backend.url).set(0)

    def on_return(self, callback: Callable[[Backend], None]) -> None:
        """Call ``callback(backend)`` whenever a backend comes back after being taken out."""
        self._returned.append(callback)

    def mark_up(self, backend: Backend) -> None:
        """Put ``backend`` (back) into service; a return tells the :meth:`on_return` callbacks."""
        if not backend.healthy:
            log.info("%s %s %s", self.role, backend.url, "back in service" if backend.was_in_service else "healthy")
            if backend.was_in_service:
                backend.returns += 1
                self._metrics.returns.labels(self.role, backend.url).inc()
                for callback in self._returned:
                    callback(backend)
        backend.healthy = True
        backend.was_in_service = True
        backend.last_error = None
        self._metrics.healthy.labels(self.role, backend.url).set(1)

    def set_kv_capacity(self, backend: Backend, tokens: float | None) -> None:
        """``backend``'s KV cache holds ``tokens`` (None: not known); exported as
        ``disagg_proxy_backend_kv_capacity_tokens`` (0 when not known)."""
        backend.kv_capacity_tokens = tokens
        self._metrics.kv_capacity.labels(self.role, backend.url).set(tokens or 0)

    def describe(self) -> str:
        """One line per backend, for error messages."""
        return "; ".join(repr(b) for b in self.backends)


class HealthProber:
    """Probes ``GET /health`` of every backend of every pool.

    Started by the app's cleanup context (``disagg.proxy.app``); :meth:`probe_all` runs once
    before the proxy serves, then :meth:`run` repeats it every ``interval`` seconds until
    cancelled. This is readiness only: it decides which engines get requests; restarting an
    engine that stopped answering is the launcher's supervisor's (``timeouts.liveness``).

    A probe answered 200 within ``timeout`` puts a backend (back) into service, and each time
    it comes into service (a new process may have another) the prober reads the size of its KV
    cache from its ``/metrics`` (:func:`read_kv_capacity`, ``Backend.kv_capacity_tokens``, which
    the routing policy uses to price the wait for room there); an engine that does not say stays
    unknown. What takes it out depends on how certain the failure is:

    - an answer other than 200, or a refused connection (nothing listens on the port): at once;
    - a probe that times out, or whose connection drops without an answer: only at the
      :data:`TIMEOUT_STRIKES`-th such failure in a row, idle or busy (a loaded engine may be
      late to answer once; one late probe took an idle engine, and with it every engine of a
      role, out of service and turned requests into 503s).
    """

    def __init__(self, pools: Sequence[BackendPool], session: aiohttp.ClientSession,
                 interval: float, timeout: float) -> None:
        self._pools = pools
        self._session = session
        self._interval = interval
        self._timeout = aiohttp.ClientTimeout(total=timeout)

    async def probe(self, pool: BackendPool, backend: Backend) -> None:
        """One probe of one backend; updates its state."""
        try:
            async with self._session.get(backend.url + "/health", timeout=self._timeout) as resp:
                await resp.read()
                backend.strikes = 0
                if resp.status == 200:
                    coming = not backend.healthy
                    pool.mark_up(backend)
                    if coming:
                        await self._read_kv_capacity(pool, backend)
                else:
                    pool.mark_down(backend, f"GET /health answered {resp.status}")
        except aiohttp.ClientConnectorError as exc:   # refused, unreachable: certain
            backend.strikes = 0
            pool.mark_down(backend, _failed(exc))
        except CLIENT_ERRORS as exc:                    # timed out, dropped: maybe only late
            backend.strikes += 1
            if backend.healthy and backend.strikes < TIMEOUT_STRIKES:
                log.info("%s %s: %s (%d of %d in a row before it is taken out; %d request(s) in flight)",
                         pool.role, backend.url, _failed(exc), backend.strikes, TIMEOUT_STRIKES, backend.outstanding)
                return
            pool.mark_down(backend, _failed(exc))

    async def _read_kv_capacity(self, pool: BackendPool, backend: Backend) -> None:
        """Read the KV cache size of a backend that came into service (:meth:`BackendPool.set_kv_capacity`)."""
        pool.set_kv_capacity(backend, await read_kv_capacity(self._session, backend.url, self._timeout))

    async def probe_all(self) -> None:
        """Probe every backend once, concurrently."""
        await asyncio.gather(*(self.probe(pool, b) for pool in self._pools for b in pool.backends))

    async def run(self) -> None:
        """Probe forever (until cancelled)."""
        while True:
            await asyncio.sleep(self._interval)
            await self.probe_all()


#: the engine metric whose labels say how large its KV cache is (vLLM: ``num_gpu_blocks`` x ``block_size``)
CACHE_INFO = "vllm:cache_config_info"


async def read_kv_capacity(session: aiohttp.ClientSession, url: str, timeout: aiohttp.ClientTimeout) -> float | None:
    """The KV cache of the engine at ``url`` in tokens, from ``GET /metrics`` (open on every
    engine the launcher starts: the engine guard lets read-only probes through), or None when it
    cannot be read or does not say (another engine kind, an older vLLM, a malformed answer)."""
    try:
        async with session.get(url + "/metrics", timeout=timeout) as resp:
            if resp.status != 200:
                return None
            text = await resp.text()
    except CLIENT_ERRORS as exc:
        log.debug("%s: KV cache size not read: %s", url, exc)
        return None
    return kv_capacity_tokens(text)


def kv_capacity_tokens(metrics_text: str) -> float | None:
    """Tokens of KV cache an engine's Prometheus text declares (``vllm:cache_config_info``'s
    ``num_gpu_blocks`` x ``block_size``), or None when it declares none or nonsense."""
    try:
        blocks = sample_label(metrics_text, CACHE_INFO, "num_gpu_blocks")
        size = sample_label(metrics_text, CACHE_INFO, "block_size")
    except (ValueError, TypeError, IndexError):      # not Prometheus text
        return None
    if blocks is None or size is None or not blocks.isdigit() or not size.isdigit():
        return None
    tokens = int(blocks) * int(size)
    return float(tokens) if tokens > 0 else None


def _failed(exc: BaseException) -> str:
    """A failed probe's reason, as ``Backend.last_error`` keeps it."""
    return f"GET /health failed: {exc.__class__.__name__}: {exc}".rstrip(": ")
