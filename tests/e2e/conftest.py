"""Session fixtures that start real vLLM engines once, at most two at a time.

Order within a session: the colocated reference server runs first (one engine,
both cores), records the greedy answer to every request in `requests_` and the
full reply to every conformance case (tests/e2e/conformance.py), and is
stopped. Deployments that several modules use (``SHARED_DEPLOYMENT``: the NIXL 1P1D of ``pd``,
and the socket connector's engines, which the streamed handoff and routing auto use with proxies
of their own) come up once
each: their modules run one after the other, wherever their files sort
(:func:`pytest_collection_modifyitems`), and every other module finds them down
(tests/e2e/shared_deployment.py). A file lock keeps concurrent sessions on this machine from
starting more engines at once.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from disagg.modelgen import build_model
from disagg.prompts import exact_prompt, load_tokenizer
from harness.engines import (
    ENGINE_ARGS,
    ENGINE_KEY,
    Running,
    bring_up,
    free_ports,
    post_json,
    write_topology,
)
from tests.e2e.conformance import Case, Recorded, build_cases, record
from tests.e2e.shared_deployment import SharedDeployment, nixl_deployment

LOCK_PATH = os.environ.get("DISAGG_ENGINE_LOCK", "/tmp/disagg-engines.lock")
#: the session's shared deployment, once a module asked for it
SHARED: pytest.StashKey[SharedDeployment] = pytest.StashKey()


def _shared_group(item: pytest.Item) -> tuple[str, int] | None:
    """(the shared deployment an item's module uses, its rank there: 0 in a module that uses it, 1 in
    the module that takes it down, 2 for the test that takes it down), or None."""
    module = getattr(item, "module", None)
    name = getattr(module, "SHARED_DEPLOYMENT", None)
    if name is None:
        return None
    takes_down = getattr(module, "TAKES_DOWN_SHARED", None)
    if takes_down is None:
        return str(name), 0
    return str(name), 2 if getattr(item, "originalname", None) == takes_down else 1


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The tests of the modules that share a deployment run one after the other, where the first of
    them was (one bring-up): those of the module that takes it down (``TAKES_DOWN_SHARED``: the
    name of the test that does) after the others, that test at the very end; every other test
    keeps its place. Runs after pytest's own ordering (a module's parametrised fixtures grouped)."""
    groups: dict[str, list[pytest.Item]] = {}
    order: list[pytest.Item | str] = []   # items, and each group's name where its first item was
    for item in items:
        group = _shared_group(item)
        if group is None:
            order.append(item)
        elif group[0] in groups:
            groups[group[0]].append(item)
        else:
            groups[group[0]] = [item]
            order.append(group[0])
    for members in groups.values():
        members.sort(key=lambda it: (_shared_group(it) or ("", 0))[1])   # stable: pytest's order within a rank
    items[:] = [member for entry in order
                for member in (groups[entry] if isinstance(entry, str) else [entry])]


@pytest.fixture(scope="session")
def engine_lock() -> Iterator[None]:
    """Hold the machine-wide engine lock for the whole session."""
    with open(LOCK_PATH, "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        yield
        fcntl.flock(fh, fcntl.LOCK_UN)


@pytest.fixture(scope="session")
def shared_deployment(request: pytest.FixtureRequest, engine_lock: None, tiny_model: Path
                      ) -> Iterator[SharedDeployment]:
    """The session's shared deployment (tests/e2e/shared_deployment.py); down at the end."""
    shared = request.config.stash[SHARED] = SharedDeployment(tiny_model)
    yield shared
    problems = shared.release()
    assert not problems, problems


def _release_shared(config: pytest.Config) -> None:
    shared = config.stash.get(SHARED, None)
    if shared is not None:
        held = shared.name
        problems = shared.release()
        assert not problems, f"taking down the shared deployment {held}: {problems}"


@pytest.fixture(scope="module", autouse=True)
def _shared_deployment_only_where_shared(request: pytest.FixtureRequest) -> None:
    """A module that does not use the shared deployment finds it down (never more than two engines)."""
    if getattr(request.module, "SHARED_DEPLOYMENT", None) is None:
        _release_shared(request.config)


@pytest.fixture(scope="session")
def e2e_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("e2e")


@pytest.fixture(scope="session")
def tiny_model(e2e_dir: Path) -> Path:
    return build_model("tiny", e2e_dir / "tiny")


@pytest.fixture(scope="session")
def tokenizer(tiny_model: Path) -> Tokenizer:
    return load_tokenizer(tiny_model)


@pytest.fixture(scope="session")
def requests_(tokenizer: Tokenizer) -> dict[str, dict]:
    """Every request whose greedy answer the tests compare, by name (OpenAI bodies).

    Each prompt has its own tag, so the decode engine's prefix cache never serves
    a prompt that an earlier test already transferred.
    """
    def completion(tag: str, tokens: int, max_tokens: int = 24) -> dict:
        return {"model": "tiny", "prompt": exact_prompt(tokenizer, tokens, tag), "max_tokens": max_tokens,
                "temperature": 0}

    def chat(tag: str, tokens: int) -> dict:
        return {"model": "tiny", "max_tokens": 24, "temperature": 0,
                "messages": [{"role": "user", "content": exact_prompt(tokenizer, tokens, tag)}]}

    reqs = {
        "short": completion("short", 50),
        "long": completion("long", 1500),
        "sync-completion": completion("sync-c", 60),
        "sync-completion-stream": completion("sync-cs", 70),
        "async-completion": completion("async-c", 80),
        "async-completion-stream": completion("async-cs", 90),
        "sync-chat": chat("sync-ch", 60),
        "sync-chat-stream": chat("sync-chs", 70),
        "async-chat": chat("async-ch", 80),
        "async-chat-stream": chat("async-chs", 90),
        "prefill-killed": completion("killed", 64),
        # a prefill engine answering alone (routing path whole), per connector, then a handoff after
        "whole-completion": completion("whole-c", 60),
        "whole-chat": chat("whole-ch", 60),
        "whole-stream": completion("whole-cs", 70),
        "whole-after": completion("whole-after", 80),
        "socket-whole-completion": completion("s-whole-c", 60),
        "socket-whole-chat": chat("s-whole-ch", 60),
        "socket-whole-stream": completion("s-whole-cs", 70),
    }
    return reqs


@pytest.fixture(scope="session")
def conformance_cases(tokenizer: Tokenizer) -> dict[str, Case]:
    """The conformance cases (tests/e2e/conformance.py), by name."""
    return build_cases(tokenizer)


class ReferenceAnswers(dict[str, str]):
    """Request name -> the reference server's greedy text; ``conformance``: case name -> its recorded reply."""

    def __init__(self, answers: dict[str, str], conformance: dict[str, Recorded]) -> None:
        super().__init__(answers)
        self.conformance = conformance


def _answer(url: str, body: dict) -> str:
    if "messages" in body:
        return post_json(url + "/v1/chat/completions", body, key=ENGINE_KEY)["choices"][0]["message"]["content"]
    return post_json(url + "/v1/completions", body, key=ENGINE_KEY)["choices"][0]["text"]


@pytest.fixture(scope="session")
def reference(request: pytest.FixtureRequest, engine_lock: None, e2e_dir: Path, tiny_model: Path,
              requests_: dict[str, dict], conformance_cases: dict[str, Case]) -> ReferenceAnswers:
    """Greedy answers of one ordinary (colocated) vLLM server, which is then stopped.

    Also records that server's whole reply (status, normalised body) to every conformance case.
    A session fixture is set up before a module's own release of the shared deployment: it
    releases it first.
    """
    _release_shared(request.config)
    proxy_port, port = free_ports(2)
    topo = write_topology(e2e_dir / "reference.yaml", tiny_model, proxy_port=proxy_port,
                          roles=f"both: [{{port: {port}, cpus: [0, 1], args: {ENGINE_ARGS}}}]\n")
    run = bring_up(topo, e2e_dir / "run-ref")
    try:
        url = run.engines["both[0]"]
        answers = {name: _answer(url, body) for name, body in requests_.items()}
        return ReferenceAnswers(answers, record(url, conformance_cases, key=ENGINE_KEY))
    finally:
        done = run.down()
        assert done.returncode == 0, done.stderr


@pytest.fixture(scope="session")
def conformance_reference(reference: ReferenceAnswers) -> dict[str, Recorded]:
    """The reference server's reply to every conformance case, by case name."""
    return reference.conformance


@pytest.fixture(scope="module")
def pd(reference: dict[str, str], e2e_dir: Path, tiny_model: Path, shared_deployment: SharedDeployment
       ) -> Running:
    """The shared NIXL 1P1D (tests/e2e/shared_deployment.py :func:`nixl_deployment`), up once the
    reference server is down; test_pd's last test stops it with Ctrl-C."""
    return nixl_deployment(shared_deployment, e2e_dir, tiny_model)
