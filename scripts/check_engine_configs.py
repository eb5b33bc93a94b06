"""Run disagg's planned SGLang argv / LMCache YAML through the engines' own parsers.

Usage (from the repository root, in a venv that has the engine installed):

    PYTHONPATH=$PWD VENV/bin/python scripts/check_engine_configs.py topologies/sglang-1p1d.yaml
    PYTHONPATH=$PWD VENV/bin/python scripts/check_engine_configs.py topologies/lmcache-1p1d.yaml

``scripts/engine-package-checks.sh`` (run by ``make test``) runs it for both
example topologies with .venv's Python and each package in a side directory.

Prints every instance's parsed values; exits 1 if the engine disagrees,
2 if the engine is not installed in this interpreter. For SGLang topologies
whose model is on local disk it also runs SGLang's whole argument resolution
(all validation hooks, the P/D one included) and prints the resolved values.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import sys
from pathlib import Path

from disagg.deployment import build_deployment
from disagg.enginecheck import EngineCheckError, check_lmcache, check_sglang, resolve_sglang
from disagg.topology import load_topology


def main(argv: list[str]) -> int:
    status = 0
    for path in argv:
        topo = load_topology(path)
        dep = build_deployment(topo)
        check, package = (check_sglang, "sglang") if topo.engine == "sglang" else (check_lmcache, "lmcache")
        if topo.engine == "vllm" and topo.connector != "lmcache":
            print(f"{path}: nothing to check (engine vllm, connector {topo.connector})")
            continue
        if importlib.util.find_spec(package) is None:
            print(f"{path}: package {package!r} is not installed in {sys.executable}")
            return 2
        version = importlib.metadata.version(package)
        for eng in dep.engines:
            try:
                values = check(eng)
            except EngineCheckError as exc:
                print(f"FAIL {path} {eng.name}: {exc}")
                status = 1
                continue
            print(f"ok   {path} {eng.name} ({package} {version}): "
                  + ", ".join(f"{k}={v!r}" for k, v in values.items()))
            if topo.engine == "sglang" and Path(topo.model.path, "config.json").exists():
                try:
                    resolved = resolve_sglang(eng)
                except EngineCheckError as exc:
                    print(f"FAIL {path} {eng.name}: {exc}")
                    status = 1
                    continue
                print("     resolved: " + ", ".join(f"{k}={v!r}" for k, v in resolved.items()))
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
