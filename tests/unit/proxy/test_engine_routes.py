"""The proxy's table of vLLM's routes matches the vLLM server this project pins.

vLLM's own app is built (no engine starts: ``build_app`` only registers routes) with the
arguments of a generation model and the default environment, in a subprocess so this
test session's environment and imports stay untouched. A route vLLM added or dropped
fails this test until :data:`disagg.proxy.engine_routes.VLLM_ROUTES` says what the proxy
does with it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from disagg.proxy.engine_routes import VLLM_ROUTES, Disposition

LIST_ROUTES = r"""
import json, warnings
warnings.simplefilter("ignore")
from starlette.routing import Mount
from vllm.entrypoints.launchers.cli_args import make_arg_parser
from vllm.entrypoints.openai import api_server
from vllm.utils.argparse_utils import FlexibleArgumentParser

args = make_arg_parser(FlexibleArgumentParser()).parse_args(["--model", "tiny"])
app = api_server.build_app(args, ("generate",))
routes = []
def walk(items, prefix=""):
    for r in items:
        if isinstance(r, Mount):
            walk(r.routes, prefix + r.path)
        elif getattr(r, "methods", None):
            routes.extend([m, prefix + r.path] for m in sorted(r.methods) if m != "HEAD")
walk(app.routes)
print("ROUTES " + json.dumps(routes))
"""


def vllm_routes() -> set[tuple[str, str]]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_SERVER_DEV")}
    out = subprocess.run([sys.executable, "-c", LIST_ROUTES], capture_output=True, text=True, env=env,
                         timeout=300, check=True)
    line = next(ln for ln in out.stdout.splitlines() if ln.startswith("ROUTES "))
    return {(m, p) for m, p in json.loads(line.removeprefix("ROUTES "))}


@pytest.mark.engine
def test_the_route_table_names_every_route_of_the_pinned_vllm() -> None:
    theirs = vllm_routes()
    ours = set(VLLM_ROUTES)
    assert theirs - ours == set(), "vLLM routes the proxy's table does not classify (engine_routes.VLLM_ROUTES)"
    assert ours - theirs == set(), "routes in the proxy's table that vLLM no longer serves"


def test_nothing_that_bypasses_the_handoff_or_administers_an_engine_is_forwarded() -> None:
    forwarded = {path for (_, path), what in VLLM_ROUTES.items() if what is Disposition.FORWARD}
    for path in ("/invocations", "/inference/v1/generate", "/scale_elastic_ep", "/load", "/ping"):
        assert path not in forwarded
