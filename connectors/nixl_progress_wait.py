"""vLLM general plugin: NIXL's progress thread waits for UCX events instead of spinning.

A NIXL agent with a UCX backend runs a progress thread (``nixlUcxSharedThread`` in NIXL's
``ucx_backend.cpp``) that progresses its UCX workers, then ``poll()``s their event descriptors
for the agent's ``pthrDelay`` rounded up to whole milliseconds. NIXL's Python API
(``nixl._api.nixl_agent``, which vLLM's NIXL connectors build) hard-codes ``pthrDelay = 0``,
so that poll returns at once and the thread spins: on a CPU engine pinned to one core it takes
half of that core from the engine's compute for as long as the engine runs (an engine alone on
one core prefilled a 1,024-token prompt in 8.2-9.7 s with NIXL, 4.0-5.4 s without a connector;
docs/engines.md). With a delay the thread sleeps in ``poll()`` until UCX signals work (a peer's
request, a completion, a notification) or the delay passes (NIXL's source notes that poll may
miss a wake-up, so the delay bounds such a miss).

With ``DISAGG_NIXL_PROGRESS_WAIT_US=<microseconds>`` in its environment (``disagg up`` sets
:data:`CPU_WAIT_US` for CPU engines that use NIXL: ``disagg.kv.nixl``), a vLLM process builds its
NIXL agents with that ``pthrDelay``. GPU engines are left as vLLM starts them: a spare core
spinning there buys latency.

Who calls what: vLLM calls :func:`register` in each process it starts (entry point
``vllm.general_plugins``). It wraps ``vllm.distributed.nixl_utils._load_nixl_attr``, through which
vLLM's NIXL connectors first reach NIXL's agent class; when that loads, :func:`wait_in_agents`
replaces the ``nixlAgent`` constructor of the bindings module that NIXL's ``_api`` calls, for the
whole process, so that every agent config reaching it carries the delay.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

ENV = "DISAGG_NIXL_PROGRESS_WAIT_US"
#: what ``disagg up`` gives CPU engines: NIXL's poll() takes whole milliseconds, so 1 ms
CPU_WAIT_US = "1000"
#: the longest delay taken (1 s): NIXL casts it to a C int of microseconds
MAX_WAIT_US = 1_000_000
#: set on what this plugin wrapped (not ``__wrapped__``, which any other wrapper may set)
MARK = "_disagg_nixl_progress_wait"

log = logging.getLogger("vllm")


def wait_us(value: str | None) -> int | None:
    """The delay ``value`` asks for in microseconds (an integer from 1 to :data:`MAX_WAIT_US`), or
    None: unset, or not one (then the agent is left as NIXL builds it, and a warning says why)."""
    if not value:
        return None
    try:
        delay = int(value)
    except ValueError:
        delay = 0
    if not 0 < delay <= MAX_WAIT_US:
        log.warning("disagg: %s=%r is not a number of microseconds from 1 to %d; NIXL's progress thread "
                    "keeps spinning", ENV, value, MAX_WAIT_US)
        return None
    return delay


def wait_in_agents(api: ModuleType, delay_us: int) -> bool:
    """Make every NIXL agent built in this process from now on use ``delay_us`` as its progress
    thread's ``pthrDelay`` (whatever the config said: NIXL's Python API always says 0): the
    ``nixlAgent`` constructor of the bindings module that NIXL's Python API module ``api`` calls is
    replaced for the whole process. False when it was replaced already,
    or when ``api`` has no such constructor (a NIXL whose API changed: a warning says so)."""
    bindings = getattr(api, "nixlBind", None)
    make_agent = getattr(bindings, "nixlAgent", None)
    if bindings is None or make_agent is None:
        log.warning("disagg: %s has no nixlBind.nixlAgent to give %s; NIXL's progress thread keeps spinning",
                    getattr(api, "__name__", api), ENV)
        return False
    if getattr(make_agent, MARK, False):
        return False

    def nixl_agent_waiting(name: str, config: Any) -> Any:
        config.pthrDelay = delay_us
        return make_agent(name, config)

    nixl_agent_waiting.__wrapped__ = make_agent  # type: ignore[attr-defined]
    setattr(nixl_agent_waiting, MARK, True)
    bindings.nixlAgent = nixl_agent_waiting
    log.info("disagg: NIXL's progress thread waits for UCX events, up to %d us at a time (pthrDelay), "
             "instead of spinning", delay_us)
    return True


def _wait_in_module_of(agent_class: Any, delay_us: int) -> None:
    """:func:`wait_in_agents` on the NIXL Python API module that defines ``agent_class`` (vLLM's
    ``NixlWrapper``: NIXL's ``nixl_agent``), if that module is loaded."""
    api = sys.modules.get(getattr(agent_class, "__module__", ""))
    if api is not None:
        wait_in_agents(api, delay_us)


def _wrap(load: Callable[[str], Any], delay_us: int) -> Callable[[str], Any]:
    def load_nixl_attr(name: str) -> Any:
        value = load(name)
        if name == "NixlWrapper" and value is not None:
            _wait_in_module_of(value, delay_us)
        return value

    setattr(load_nixl_attr, MARK, True)
    return functools.update_wrapper(load_nixl_attr, load, assigned=(), updated=())


def register() -> None:
    """vLLM calls this in every process it starts; active only with ``DISAGG_NIXL_PROGRESS_WAIT_US`` set."""
    delay_us = wait_us(os.environ.get(ENV))
    if delay_us is None:
        return
    try:
        from vllm.distributed import nixl_utils
    except ImportError:  # a vLLM without NIXL support
        return
    current = nixl_utils._load_nixl_attr
    if getattr(current, MARK, False):  # registered already in this process
        return
    loaded = nixl_utils.__dict__.get("NixlWrapper")
    if loaded is not None:  # NIXL reached before the plugins loaded: wrap its module now
        _wait_in_module_of(loaded, delay_us)
    nixl_utils._load_nixl_attr = _wrap(current, delay_us)
