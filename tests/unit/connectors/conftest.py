"""Make ``disagg_connectors`` importable from this checkout's ``connectors/``.

The venv's editable install may map the package to another checkout; tests
must exercise this one. Every test here runs the listener with short polls of its own
(``_quick_listener_polls``).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

_ROOT = Path(__file__).resolve().parents[3] / "connectors"
_spec = sys.modules.get("disagg_connectors")
if _spec is None or Path(_spec.__file__ or "").resolve().parent != _ROOT:
    spec = importlib.util.spec_from_file_location("disagg_connectors", _ROOT / "__init__.py",
                                                  submodule_search_locations=[str(_ROOT)])
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules["disagg_connectors"] = module
    spec.loader.exec_module(module)

from tests.unit.connectors.kvdata import served  # noqa: E402,F401  (the listener fixture)


@pytest.fixture(autouse=True)
def _quick_listener_polls(monkeypatch: pytest.MonkeyPatch) -> None:
    """The listener's own polls, short: its accept loop notices close() (which waits for it) and a
    stream notices that its reader left within 20 ms instead of 0.5 s and 0.25 s. Every deadline a
    test checks is a parameter of its own (``io_timeout_s``, ``stream_wait_s``, ...)."""
    from disagg_connectors.socket_connector import server

    monkeypatch.setattr(server, "ACCEPT_POLL_S", 0.02)
    monkeypatch.setattr(server, "STREAM_POLL_S", 0.02)
