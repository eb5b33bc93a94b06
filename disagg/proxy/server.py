"""Serving the proxy: :class:`ProxyServer` (``async with``, tests and
embedding) and :func:`run_proxy` (the ``disagg proxy`` process, with signals)."""

from __future__ import annotations

import asyncio
import enum
import logging
import signal
from collections.abc import Callable
from types import TracebackType

from aiohttp import web

from disagg.errors import ProxyError
from disagg.proxy.app import STATE, ProxyState, build_app
from disagg.proxy.config import ProxyConfig

log = logging.getLogger("disagg.proxy")


class ServerState(enum.Enum):
    NEW = "new"
    RUNNING = "running"
    CLOSED = "closed"


class ProxyServer:
    """Serves one proxy app on ``config.host:config.port`` (port 0: a free port).

    ``async with ProxyServer(cfg) as server:`` starts it (health probes have
    run once) and ``server.url`` is where it listens; leaving the block stops
    accepting, lets in-flight requests finish for ``timeouts.drain`` seconds,
    then cancels them. :meth:`aclose` is idempotent; a closed server cannot be
    started again.
    """

    def __init__(self, config: ProxyConfig, *, access_log: bool = False) -> None:
        self.config = config
        self.app = build_app(config)
        # aiohttp's keep-alive timer runs from a connection's start (and from the end of each
        # reply) until a whole request head has arrived: nginx's client_header_timeout
        self._runner = web.AppRunner(self.app, handler_cancellation=True, shutdown_timeout=config.timeouts.drain,
                                     keepalive_timeout=config.timeouts.client_header,
                                     access_log=logging.getLogger("aiohttp.access") if access_log else None)
        self._state = ServerState.NEW
        self.port: int | None = None

    @property
    def app_state(self) -> ProxyState:
        """The app's pools, metrics and clients (for tests and embedding)."""
        return self.app[STATE]

    @property
    def url(self) -> str:
        """``http://host:port`` of the listening proxy."""
        if self.port is None:
            raise ProxyError("the proxy is not listening")
        host = self.config.host
        host = "127.0.0.1" if host in ("0.0.0.0", "") else "[::1]" if host == "::" else host
        return f"http://[{host}]:{self.port}" if ":" in host and not host.startswith("[") else f"http://{host}:{self.port}"

    async def start(self) -> None:
        """Bind and serve; raises :class:`ProxyError` if the address is taken."""
        if self._state is not ServerState.NEW:
            raise ProxyError(f"this ProxyServer is {self._state.value}; create a new one")
        self._state = ServerState.RUNNING
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.config.host, self.config.port, reuse_address=True)
        try:
            await site.start()
        except OSError as exc:
            await self.aclose()
            raise ProxyError(f"proxy cannot listen on {self.config.host}:{self.config.port}: {exc}") from exc
        address = self._runner.addresses[0]
        self.port = int(address[1])

    async def aclose(self) -> None:
        """Stop accepting, drain, close (idempotent)."""
        if self._state is ServerState.CLOSED:
            return
        self._state = ServerState.CLOSED
        await self._runner.cleanup()

    async def __aenter__(self) -> ProxyServer:
        await self.start()
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.aclose()


async def serve_until_signal(config: ProxyConfig, *, access_log: bool = False) -> int:
    """Serve until SIGTERM/SIGINT, then drain and return 0; a second signal
    stops draining and returns 1."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    main = asyncio.current_task()
    forced = False

    def on_signal() -> None:
        nonlocal forced
        if stop.is_set():
            forced = True
            if main is not None:
                main.cancel()
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal)
    try:
        async with ProxyServer(config, access_log=access_log) as server:
            mode = "colocated" if config.colocated else f"{config.handoff} prefill->decode"
            log.info("listening on %s (%s; prefill %s; decode %s)", server.url, mode,
                     ", ".join(config.prefill) or "-", ", ".join(config.decode))
            await stop.wait()
            log.info("stopping: draining in-flight requests (up to %ss)", config.timeouts.drain)
        return 0
    except asyncio.CancelledError:
        if forced:
            log.warning("second signal: stopped without draining")
            return 1
        raise
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)


LOOPS = ("auto", "asyncio", "uvloop")


def loop_factory(loop: str) -> Callable[[], asyncio.AbstractEventLoop] | None:
    """The event loop factory for ``--loop``: ``auto`` is uvloop when installed
    (it roughly halves the proxy's per-event CPU), else asyncio's."""
    if loop not in LOOPS:
        raise ProxyError(f"loop must be one of {', '.join(LOOPS)}, got {loop!r}")
    if loop == "asyncio":
        return None
    try:
        import uvloop
    except ImportError:
        if loop == "uvloop":
            raise ProxyError("--loop uvloop: uvloop is not installed (pip install uvloop)") from None
        return None
    return uvloop.new_event_loop


def run_proxy(config: ProxyConfig, *, access_log: bool = False, loop: str = "auto") -> int:
    """Run the proxy in this process until a signal; returns the exit status."""
    with asyncio.Runner(loop_factory=loop_factory(loop)) as runner:
        return runner.run(serve_until_signal(config, access_log=access_log))
