"""ProxyConfig validation and the ``disagg proxy`` arguments."""

from __future__ import annotations

import pytest

from disagg.cli import build_parser
from disagg.errors import ProxyError
from disagg.proxy.config import ProxyConfig, ProxyTimeouts


def test_urls_are_normalized_and_mode_follows_prefill() -> None:
    cfg = ProxyConfig(decode=("http://d:8200/",), prefill=("http://p:8100",))
    assert cfg.decode == ("http://d:8200",) and not cfg.colocated
    assert ProxyConfig(decode=("http://d:1",)).colocated


@pytest.mark.parametrize(("kwargs", "needle"), [
    ({"decode": ()}, "at least one --decode"),
    ({"decode": ("d:8200",)}, "decode URL 'd:8200'"),
    ({"decode": ("http://d:99999",)}, "decode URL 'http://d:99999'"),
    ({"decode": ("http://d:1",), "prefill": ("ftp://p:1",)}, "prefill URL 'ftp://p:1'"),
    ({"decode": ("http://d:1", "http://d:1/")}, "decode URLs repeat"),
    ({"decode": ("http://d:1",), "fallback": "sometimes"}, "fallback must be one of local, never"),
    ({"decode": ("http://d:1",), "api_key": ""}, "api_key must not be empty"),
    ({"decode": ("http://d:1",), "engine_key": ""}, "engine_key must not be empty"),
    ({"decode": ("http://d:1",), "engine_key": "two words"}, "engine_key must be printable ASCII without spaces"),
    ({"decode": ("http://d:1",), "engine_key": "line\nbreak"}, "engine_key must be printable ASCII"),
    ({"decode": ("http://d:1",), "max_concurrency": 0}, "max_concurrency must be a whole number >= 1"),
])
def test_invalid_config_names_the_field(kwargs: dict, needle: str) -> None:
    with pytest.raises(ProxyError, match=needle.replace("?", r"\?")):
        ProxyConfig(**kwargs)


def test_timeouts_must_be_positive() -> None:
    with pytest.raises(ProxyError, match="request must be > 0"):
        ProxyTimeouts(request=0)


def test_unknown_engine_is_refused_when_building_the_app() -> None:
    from disagg.proxy import build_app

    with pytest.raises(ProxyError, match="engine 'tgi' has no proxy handoff"):
        build_app(ProxyConfig(decode=("http://d:1",), prefill=("http://p:1",), handoff="tgi"))
    build_app(ProxyConfig(decode=("http://d:1",), handoff="tgi"))  # colocated needs no handoff


def test_cli_arguments_round_trip(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DISAGG_PROXY_API_KEY", raising=False)
    monkeypatch.delenv("DISAGG_ENGINE_KEY", raising=False)
    cfg = ProxyConfig(decode=("http://d:2", "http://d:3"), prefill=("http://p:1",), host="0.0.0.0", port=9000,
                      api_key="k", engine_key="ek", fallback="never", max_concurrency=7, log_level="debug",
                      timeouts=ProxyTimeouts(connect=1.5, request=30, health_interval=0.5, health_timeout=2,
                                             drain=4))
    args = build_parser().parse_args(cfg.to_argv())
    assert ProxyConfig.from_args(args) == cfg


def test_without_keys_the_argv_has_neither_and_the_environment_supplies_both(
        monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = ProxyConfig(decode=("http://d:2",), api_key="client-secret", engine_key="engine-secret")
    argv = cfg.to_argv(with_api_key=False)
    assert not any("secret" in a for a in argv) and "--api-key" not in argv and "--engine-key" not in argv
    monkeypatch.setenv("DISAGG_PROXY_API_KEY", "client-secret")
    monkeypatch.setenv("DISAGG_ENGINE_KEY", "engine-secret")
    assert ProxyConfig.from_args(build_parser().parse_args(argv)) == cfg
    assert "engine-secret" not in repr(cfg)


def test_engine_key_from_environment_or_flag(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DISAGG_ENGINE_KEY", raising=False)
    assert ProxyConfig.from_args(build_parser().parse_args(["proxy", "--decode", "http://d:1"])).engine_key is None
    monkeypatch.setenv("DISAGG_ENGINE_KEY", "")  # empty is unset
    assert ProxyConfig.from_args(build_parser().parse_args(["proxy", "--decode", "http://d:1"])).engine_key is None
    monkeypatch.setenv("DISAGG_ENGINE_KEY", "from-env")
    args = build_parser().parse_args(["proxy", "--decode", "http://d:1"])
    assert ProxyConfig.from_args(args).engine_key == "from-env"
    args = build_parser().parse_args(["proxy", "--decode", "http://d:1", "--engine-key", "flag"])
    assert ProxyConfig.from_args(args).engine_key == "flag"


def test_api_key_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DISAGG_PROXY_API_KEY", "from-env")
    args = build_parser().parse_args(["proxy", "--decode", "http://d:1"])
    cfg = ProxyConfig.from_args(args)
    assert cfg.api_key == "from-env" and cfg.colocated and cfg.port == 8000 and cfg.host == "127.0.0.1"


def test_the_handoff_flag_and_its_old_name() -> None:
    for flag in ("--handoff", "--engine"):  # --engine: the name before it said what it selects
        args = build_parser().parse_args(["proxy", "--decode", "http://d:1", "--prefill", "http://p:1",
                                          flag, "vllm-lmcache"])
        assert ProxyConfig.from_args(args).handoff == "vllm-lmcache"


AUTO = {"policy": "auto", "kv_bytes_per_token": 1024.0, "prefill_tokens_per_s": 2000.0, "link_bytes_per_s": 1e9}


def test_route_streaming_layers_go_with_the_streaming_handoff_only(monkeypatch: pytest.MonkeyPatch) -> None:
    from disagg.proxy.config import STREAMING_HANDOFF, RoutingConfig
    from disagg.proxy.socket_stream_handoff import SocketStreamHandoff

    monkeypatch.delenv("DISAGG_PROXY_API_KEY", raising=False)
    monkeypatch.delenv("DISAGG_ENGINE_KEY", raising=False)
    assert STREAMING_HANDOFF == SocketStreamHandoff.kind
    urls = {"decode": ("http://d:1",), "prefill": ("http://p:1",)}
    cfg = ProxyConfig(**urls, handoff=STREAMING_HANDOFF, routing=RoutingConfig(**AUTO, streaming_layers=32))
    argv = cfg.to_argv()
    assert argv[argv.index("--route-streaming-layers") + 1] == "32"
    assert ProxyConfig.from_args(build_parser().parse_args(argv)) == cfg
    assert "--route-streaming-layers" not in ProxyConfig(**urls, routing=RoutingConfig(**AUTO)).to_argv()
    for bad in (0, -3, True, 2.5, "32"):
        with pytest.raises(ProxyError, match="routing streaming_layers must be a whole number >= 1"):
            RoutingConfig(**AUTO, streaming_layers=bad)
    with pytest.raises(ProxyError, match="prices the vllm-socket-stream handoff; handoff vllm sends the KV after"):
        ProxyConfig(**urls, routing=RoutingConfig(**AUTO, streaming_layers=32))
    with pytest.raises(ProxyError, match="auto with handoff vllm-socket-stream needs --route-streaming-layers N"):
        ProxyConfig(**urls, handoff=STREAMING_HANDOFF, routing=RoutingConfig(**AUTO))
    # without auto there is nothing to price: the static policies need no layers
    ProxyConfig(**urls, handoff=STREAMING_HANDOFF, routing=RoutingConfig(policy="split"))
    args = build_parser().parse_args(["proxy", "--decode", "http://d:1", "--prefill", "http://p:1", "--handoff",
                                      STREAMING_HANDOFF, "--routing-policy", "auto", "--route-kv-bytes-per-token",
                                      "1024", "--route-prefill-rate", "2000", "--route-link-rate", "1e9",
                                      "--route-streaming-layers", "0"])
    with pytest.raises(ProxyError, match="streaming_layers must be a whole number >= 1"):
        ProxyConfig.from_args(args)


def test_every_setting_is_declared_once_and_round_trips_off_its_default(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each field's flag makes the argument, the argv and the value: a config with every setting off its
    default comes back whole, a default one is only its URLs, and docs/proxy.md lists every flag."""
    from pathlib import Path

    from disagg.proxy import flags
    from disagg.proxy.config import RoutingConfig

    monkeypatch.delenv("DISAGG_PROXY_API_KEY", raising=False)
    monkeypatch.delenv("DISAGG_ENGINE_KEY", raising=False)
    assert ProxyConfig(decode=("http://d:1",)).to_argv() == ["proxy", "--decode", "http://d:1"]
    routing = RoutingConfig(policy="auto", kv_bytes_per_token=512.0, prefill_tokens_per_s=900.0,
                            decode_tokens_per_s=800.0, link_bytes_per_s=1e8, handoff_fixed_s=0.02, overhead_s=0.01,
                            stall_weight=2.0, whole=True, tokenizer="/m/tokenizer.json", chars_per_token=3.5,
                            explore_after_s=5.0, explore_decisions=3, explore_within=0.0,
                            measured_rates=("prefill", "decode"), slo_ttft_s=0.5, slo_tpot_s=0.025)
    cfg = ProxyConfig(decode=("http://d:1", "http://d:2"), prefill=("http://p:1",), host="::1", port=0,
                      handoff="sglang", api_key="a", engine_key="e", fallback="never", max_concurrency=2,
                      max_prompts=3, max_body_bytes=4,
                      timeouts=ProxyTimeouts(connect=1, request=2, health_interval=3, health_timeout=4, drain=5,
                                             client_header=6, client_body=7, send=8),
                      handoff_options=(("bootstrap_ports", "1"), ("x", "y=z")), routing=routing, log_level="debug")
    argv = cfg.to_argv()
    declared = [s.flag.name for s in flags.settings(ProxyConfig)]
    assert sorted(a for a in argv if a.startswith("--") and a != "--handoff-option") == \
        sorted(n for n in declared if n != "--handoff-option" and n != "--route-streaming-layers")
    assert ProxyConfig.from_args(build_parser().parse_args(argv)) == cfg
    page = (Path(__file__).parents[3] / "docs" / "proxy.md").read_text()
    assert [n for n in declared if f"`{n}" not in page] == []
