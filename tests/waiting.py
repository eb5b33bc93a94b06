"""Waiting for a condition instead of sleeping a fixed time: a loaded machine may overrun any
fixed sleep, and an idle one wastes most of it. For the synchronous tests; the proxy's asyncio
tests have ``wait_for`` in tests/unit/proxy/proxy_standin.py."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_until(condition: Callable[[], T], timeout_s: float = 10.0, what: str = "",
               interval_s: float = 0.02) -> T:
    """Poll ``condition()`` until it returns something true, and return that; fail the test
    (AssertionError naming ``what``) once ``timeout_s`` seconds have passed without it."""
    deadline = time.monotonic() + timeout_s
    while not (value := condition()):
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s:g} s: {what or condition}")
        time.sleep(interval_s)
    return value
