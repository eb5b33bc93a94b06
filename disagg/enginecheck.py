"""Check planned engine configurations with the engines' own parsers.

- SGLang: an instance's argv goes through SGLang's ``prepare_server_args``
  (the parser ``python -m sglang.launch_server`` uses), and the parsed
  ``ServerArgs`` must hold the values disagg meant.
- LMCache: an instance's generated YAML goes through LMCache's
  ``load_engine_config_with_overrides`` (what ``LMCACHE_CONFIG_FILE`` feeds),
  every key must be one LMCache knows, and each value must load unchanged.

The engines are imported only here and only when called, so the module
imports anywhere; run it in a virtual environment that has the engine
(``scripts/check_engine_configs.py``, tests that skip without it).
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import yaml

from disagg.deployment import EngineLaunch
from disagg.errors import DisaggError
from disagg.kv.lmcache import CONFIG_SUFFIX

#: SGLang ServerArgs field <- the flag disagg writes
SGLANG_FIELDS = {
    "--model-path": "model_path", "--served-model-name": "served_model_name", "--host": "host",
    "--port": "port", "--dtype": "dtype", "--context-length": "context_length", "--tp-size": "tp_size",
    "--device": "device", "--disaggregation-mode": "disaggregation_mode",
    "--disaggregation-transfer-backend": "disaggregation_transfer_backend",
    "--disaggregation-bootstrap-port": "disaggregation_bootstrap_port",
    "--disaggregation-ib-device": "disaggregation_ib_device", "--mem-fraction-static": "mem_fraction_static",
}


class EngineCheckError(DisaggError):
    """An engine's own parser disagreed with a planned configuration."""


def sglang_server_args(eng: EngineLaunch) -> Any:
    """The ``ServerArgs`` SGLang's own CLI parser makes of ``eng``'s argv."""
    from sglang.srt.server_args import prepare_server_args

    argv = list(eng.argv)
    if argv[1:3] != ["-m", "sglang.launch_server"]:
        raise EngineCheckError(f"{eng.name}: not an SGLang command line: {argv[:3]}")
    try:
        return prepare_server_args(argv[3:])
    except SystemExit as exc:  # argparse rejected a flag or value (its message went to stderr)
        raise EngineCheckError(f"{eng.name}: SGLang's parser rejected the command line (exit {exc.code})") from None


def check_sglang(eng: EngineLaunch) -> dict[str, Any]:
    """Parse ``eng``'s argv with SGLang; return field -> parsed value; raise if any differs."""
    args = sglang_server_args(eng)
    argv = list(eng.argv)
    seen: dict[str, Any] = {}
    for i, flag in enumerate(argv):
        field = SGLANG_FIELDS.get(flag)
        if field is None:
            continue
        parsed = getattr(args, field)
        seen[field] = parsed
        if str(parsed) != argv[i + 1]:
            raise EngineCheckError(f"{eng.name}: {flag} {argv[i + 1]} parsed as {field}={parsed!r}")
    if "--enable-metrics" in argv:
        seen["enable_metrics"] = args.enable_metrics
        if args.enable_metrics is not True:
            raise EngineCheckError(f"{eng.name}: --enable-metrics parsed as {args.enable_metrics!r}")
    return seen


def resolve_sglang(eng: EngineLaunch) -> dict[str, Any]:
    """Run SGLang's whole argument resolution (every validation hook, the P/D one
    included) on ``eng``'s argv; needs the model's config on local disk.
    Returns the resolved disaggregation settings."""
    from sglang.srt.arg_groups.overrides import resolving_view

    args = sglang_server_args(eng)
    try:
        args.resolve_once()
    except (ValueError, AssertionError) as exc:
        raise EngineCheckError(f"{eng.name}: SGLang's resolution rejected the arguments: {exc}") from None
    view = resolving_view(args)
    keys = ("disaggregation_mode", "disaggregation_transfer_backend", "disaggregation_bootstrap_port",
            "disaggregation_ib_device", "device", "disable_radix_cache")
    return {k: getattr(view, k) for k in keys}


def check_lmcache(eng: EngineLaunch) -> dict[str, Any]:
    """Load ``eng``'s LMCache YAML with LMCache's loader; return key -> loaded value; raise if any differs."""
    from lmcache.v1.config import LMCacheEngineConfig, load_engine_config_with_overrides

    files = [(n, t) for n, t in eng.files if n.endswith(CONFIG_SUFFIX)]
    if len(files) != 1:
        raise EngineCheckError(f"{eng.name}: expected one LMCache config file, got {[n for n, _ in files]}")
    name, text = files[0]
    written = yaml.safe_load(text)
    known = set(getattr(LMCacheEngineConfig, "__dataclass_fields__", {}))
    unknown = sorted(set(written) - known) if known else []
    if unknown:
        raise EngineCheckError(f"{eng.name}: {name}: keys LMCache does not know: {', '.join(unknown)}")
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / name
        path.write_text(text)
        cfg = load_engine_config_with_overrides(config_file_path=str(path))
    loaded = {key: getattr(cfg, key) for key in written}
    for key, value in written.items():
        if loaded[key] != value:
            raise EngineCheckError(f"{eng.name}: {name}: {key}: wrote {value!r}, LMCache loaded {loaded[key]!r}")
    return loaded
