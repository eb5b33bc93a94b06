"""The conformance cases' classes (tests/e2e/conformance.py) against the proxy's own plan of each case.

A case is ``handoff`` when the proxy plans every route of it ``split`` (a connector takes part in
its answer) and ``local`` when it sends it whole to the decode engine; the e2e suites run the
``local`` cases against the NIXL 1P1D only, so a case classified ``local`` that the proxy would
split would go untested on the other connectors: this test fails then.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from multidict import CIMultiDict

from disagg.modelgen import build_model
from disagg.prompts import load_tokenizer
from disagg.proxy.app import _json_object
from disagg.proxy.routes import GenerationRequest, RoutePath, plan_request
from tests.e2e.conformance import CASE_CLASS, CASE_CLASSES, CASE_NAMES, HANDOFF_CASES, KV_CASE, Case, build_cases


@pytest.fixture(scope="module")
def cases(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Case]:
    model: Path = build_model("tiny", tmp_path_factory.mktemp("m") / "tiny")
    return build_cases(load_tokenizer(model))


def planned_paths(case: Case) -> list[RoutePath]:
    """The paths the proxy (routing policy split) plans for the case's routes, its body read as
    the proxy reads it (a body that is not a JSON object goes on unparsed)."""
    raw = case.payload()
    body = _json_object(raw)
    headers: CIMultiDict[str] = CIMultiDict()
    if body is None:
        req = GenerationRequest(case.endpoint, {}, raw, headers, "r", parsed=False)
    else:
        req = GenerationRequest(case.endpoint, body, raw, headers, "r")
    return [route.path for route in plan_request(req, split=True).routes]


def test_every_case_has_one_known_class() -> None:
    assert set(CASE_CLASS) == {*CASE_NAMES, KV_CASE}
    assert set(CASE_CLASS.values()) == set(CASE_CLASSES)
    assert HANDOFF_CASES == tuple(n for n in CASE_NAMES if CASE_CLASS[n] == "handoff")
    assert 0 < len(HANDOFF_CASES) < len(CASE_NAMES)


@pytest.mark.parametrize("name", [*CASE_NAMES, KV_CASE])
def test_the_class_is_the_route_the_proxy_plans(cases: dict[str, Case], name: str) -> None:
    paths = planned_paths(cases[name])
    expected = RoutePath.SPLIT if CASE_CLASS[name] == "handoff" else RoutePath.LOCAL
    assert paths and set(paths) == {expected}, (name, CASE_CLASS[name], paths)
