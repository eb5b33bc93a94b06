"""Make ``disagg_connectors`` importable from this checkout's ``connectors/``.

The venv's editable install may map the package to another checkout; tests
must exercise this one.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

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
