"""The e2e session's module order (tests/e2e/conftest.py ``pytest_collection_modifyitems``) on
stand-in items: the modules of each shared deployment run one after the other wherever their files
sort, the module that takes it down last and its stopping test at the very end; every other test
keeps its place. No engines."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, cast

import pytest

from tests.e2e.conftest import pytest_collection_modifyitems


def _module(name: str, **shared: object) -> SimpleNamespace:
    return SimpleNamespace(__name__=name, **shared)


def _items(*specs: tuple[SimpleNamespace, str]) -> list[Any]:
    """Stand-ins for pytest items: what the hook reads of them (module, originalname, a name)."""
    return [SimpleNamespace(module=module, originalname=test, nodeid=f"{module.__name__}::{test}")
            for module, test in specs]


def _order(items: list[Any]) -> list[str]:
    pytest_collection_modifyitems(cast(list[pytest.Item], items))
    return [item.nodeid for item in items]


def test_each_shared_deployment_runs_its_modules_together_and_is_taken_down_last() -> None:
    own = _module("emulated")                        # starts engines of its own
    crafted = _module("crafted", SHARED_DEPLOYMENT="nixl")
    pd = _module("pd", SHARED_DEPLOYMENT="nixl", TAKES_DOWN_SHARED="test_ctrl_c")
    push = _module("push")
    conformance = _module("sconf", SHARED_DEPLOYMENT="socket", TAKES_DOWN_SHARED="test_down")
    auto = _module("auto", SHARED_DEPLOYMENT="socket")
    items = _items((own, "a"), (crafted, "b"), (pd, "c"), (pd, "test_ctrl_c"), (pd, "d"), (push, "e"),
                   (conformance, "f"), (conformance, "test_down"), (conformance, "g"), (crafted, "h"),
                   (auto, "j"))
    assert _order(items) == [
        "emulated::a",
        # the NIXL group where its first test was: its users, then the module that takes it down
        # (in its own order), then the stopping test
        "crafted::b", "crafted::h", "pd::c", "pd::d", "pd::test_ctrl_c",
        "push::e",
        # the socket group: users, the taking-down module, the stopping test
        "auto::j", "sconf::f", "sconf::g", "sconf::test_down",
    ]


def test_without_shared_deployments_the_order_is_kept() -> None:
    a, b = _module("a"), _module("b")
    items = _items((b, "x"), (a, "y"), (b, "z"))
    assert _order(items) == ["b::x", "a::y", "b::z"]
