"""Topology parsing: the happy path and every error path, with exact messages."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from disagg.errors import TopologyError
from disagg.topology import load_topology, parse_rate, parse_topology

GOOD = """\
model: {path: disagg:tiny, max_model_len: 2048}
engine: vllm
connector: nixl
link: {type: ethernet, rate: 2.5gbit}
hosts:
  a: {address: 127.0.0.1}
  b: {address: 127.0.0.1}
roles:
  prefill:
    - {host: a, port: 8100, cpus: "0"}
  decode:
    - {host: b, port: 8200, cpus: [1], env: {FOO: bar}, args: [--max-num-seqs, 4]}
"""


def parse(text: str):
    return parse_topology(textwrap.dedent(text), "topo.yaml", run_dir="/tmp/run")


def error_of(text: str) -> str:
    with pytest.raises(TopologyError) as info:
        parse(text)
    return str(info.value)


def test_good_topology_is_typed() -> None:
    topo = parse(GOOD)
    assert topo.engine == "vllm" and topo.connector == "nixl" and not topo.colocated
    assert topo.link.rate_bps == 2.5e9
    assert topo.model.embedded == "tiny" and topo.model.path == "/tmp/run/models/tiny"
    assert topo.model.max_model_len == 2048
    prefill, decode = topo.role("prefill")[0], topo.role("decode")[0]
    assert (prefill.port, prefill.cpus, prefill.kv_port) == (8100, (0,), 5600)
    assert (decode.port, decode.cpus, decode.kv_port) == (8200, (1,), 5601)
    assert decode.args == ("--max-num-seqs", "4") and dict(decode.env) == {"FOO": "bar"}
    assert topo.proxy.host == "127.0.0.1" and topo.proxy.port == 8000


def test_wrong_type() -> None:
    msg = error_of(GOOD.replace("port: 8200", "port: eighty"))
    assert msg == "topo.yaml:12: roles.decode[0].port: expected an integer, got the string 'eighty'"


def test_unknown_key_with_hint() -> None:
    msg = error_of(GOOD.replace("engine: vllm", "engnie: vllm"))
    assert msg.startswith("topo.yaml:2: engnie: unknown field (did you mean 'engine'?)")


def test_unknown_nested_key() -> None:
    msg = error_of(GOOD.replace("{host: a, port: 8100", "{host: a, prot: 8100"))
    assert msg == "topo.yaml:10: roles.prefill[0].prot: unknown field (did you mean 'port'?)"


def test_missing_port_is_required() -> None:
    msg = error_of(GOOD.replace("{host: a, port: 8100, cpus: \"0\"}", "{host: a}"))
    assert msg == "topo.yaml:10: roles.prefill[0].port: is required but missing"


def test_duplicate_port() -> None:
    msg = error_of(GOOD.replace("port: 8200", "port: 8100"))
    assert msg == "topo.yaml:12: roles.decode[0].port: 8100 is already used by roles.prefill[0]"


def test_duplicate_port_with_proxy() -> None:
    msg = error_of(GOOD + "proxy: {port: 8200}\n")
    assert msg == "topo.yaml:13: proxy.port: 8200 is already used by roles.decode[0]"


def test_same_port_on_different_addresses_is_fine() -> None:
    topo = parse(GOOD.replace("b: {address: 127.0.0.1}", "b: {address: 127.0.0.2}").replace("port: 8200", "port: 8100")
                 .replace("type: ethernet, rate: 2.5gbit", "type: loopback"))
    assert [i.port for i in topo.instances] == [8100, 8100]


def test_missing_role() -> None:
    text = GOOD.split("  decode:")[0]
    msg = error_of(text)
    assert msg == ("topo.yaml:8: roles.decode: is missing: a disaggregated topology needs prefill and decode "
                   "instances (or a single 'both' list for a colocated one)")


def test_both_mixed_with_prefill() -> None:
    msg = error_of(GOOD + "    both: []\n".replace("    both", "  both"))
    assert "roles.both" in msg and msg.startswith("topo.yaml:")


def test_bad_link_rate() -> None:
    msg = error_of(GOOD.replace("rate: 2.5gbit", "rate: 2.5 gigs"))
    assert msg == ("topo.yaml:4: link.rate: bad link rate '2.5 gigs': expected a positive number followed by "
                   "bit, kbit, mbit, gbit or tbit, e.g. 2.5gbit")


def test_emulated_link_needs_rate() -> None:
    msg = error_of(GOOD.replace("type: ethernet, rate: 2.5gbit", "type: emulated"))
    assert msg == "topo.yaml:4: link.rate: an emulated link needs a rate, e.g. rate: 1gbit"


def test_bad_choice_lists_the_choices() -> None:
    msg = error_of(GOOD.replace("connector: nixl", "connector: nixel"))
    assert msg == ("topo.yaml:3: connector: expected one of nixl, nixl-push, lmcache, socket, mooncake, got 'nixel' "
                   "(did you mean 'nixl'?)")


@pytest.mark.parametrize("form", ["nixl-push", "{type: nixl-push}", "{type: nixl-push, wire_format: raw}"])
def test_nixl_push_connector_in_either_form(form: str) -> None:
    topo = parse(GOOD.replace("connector: nixl", f"connector: {form}"))
    assert topo.connector == "nixl-push" and topo.wire_format == "raw" and not topo.streaming
    # its engines get a side channel each, as with nixl
    assert [i.kv_port for i in topo.instances] == [5600, 5601]


@pytest.mark.parametrize(("form", "message"), [
    ("{type: nixl-push, streaming: true}", "topo.yaml:3: connector.streaming: streaming needs connector type socket "
                                           "(it is how our socket connector hands the KV over; connector nixl-push "
                                           "has no such setting)"),
    ("{type: nixl-push, wire_format: fp8}", "topo.yaml:3: connector.wire_format: wire_format fp8 needs connector "
                                            "type socket (connector nixl-push sends the cache's own bytes)"),
    ("nixl_push", "topo.yaml:3: connector: expected one of nixl, nixl-push, lmcache, socket, mooncake, got "
                  "'nixl_push' (did you mean 'nixl-push'?)"),
])
def test_nixl_push_connector_errors(form: str, message: str) -> None:
    assert error_of(GOOD.replace("connector: nixl", f"connector: {form}")) == message


def test_unknown_host() -> None:
    msg = error_of(GOOD.replace("{host: b,", "{host: c,"))
    assert msg == "topo.yaml:12: roles.decode[0].host: unknown host 'c'; hosts are a, b"


def test_unreachable_file(tmp_path: Path) -> None:
    with pytest.raises(TopologyError) as info:
        load_topology(tmp_path / "nope.yaml")
    assert str(info.value) == f"{tmp_path / 'nope.yaml'}: file not found"


def test_invalid_yaml_names_line() -> None:
    msg = error_of("model: x\nhosts: [\n")
    assert msg.startswith("topo.yaml:3: invalid YAML")


def test_empty_file() -> None:
    assert error_of("") == "topo.yaml:1: the file is empty; expected a mapping of topology fields"


def test_duplicate_key() -> None:
    msg = error_of(GOOD + "engine: sglang\n")
    assert msg == "topo.yaml:13: engine: appears twice in the same mapping"


def test_colocated_has_no_kv_port() -> None:
    topo = parse("""\
        model: /models/x
        hosts: {h: {address: 127.0.0.1}}
        roles: {both: [{port: 8300}]}
    """)
    assert topo.colocated and topo.instances[0].kv_port is None and topo.instances[0].host == "h"
    assert topo.model.path == "/models/x"


def test_gpus_need_cuda_host() -> None:
    msg = error_of(GOOD.replace('cpus: "0"', "gpus: [0]"))
    assert msg == "topo.yaml:10: roles.prefill[0].gpus: host 'a' has device: cpu; set device: cuda to use gpus"


def test_cpu_ranges() -> None:
    topo = parse(GOOD.replace('cpus: "0"', 'cpus: "0-2,5"'))
    assert topo.role("prefill")[0].cpus == (0, 1, 2, 5)


@pytest.mark.parametrize(("text", "bps"), [("1gbit", 1e9), ("2.5gbit", 2.5e9), ("100mbit", 1e8), ("10GBIT", 1e10)])
def test_parse_rate(text: str, bps: float) -> None:
    assert parse_rate(text) == bps


def test_parse_rate_rejects_zero() -> None:
    with pytest.raises(ValueError, match="bad link rate"):
        parse_rate("0gbit")


def test_reference_example_in_docs_is_valid() -> None:
    doc = (Path(__file__).resolve().parents[2] / "docs" / "topology.md").read_text()
    example = doc.split("```yaml\n", 1)[1].split("```", 1)[0]
    topo = parse_topology(example, "docs/topology.md", run_dir="/tmp/run")
    assert topo.hosts["far"].ssh == "me@far.lan" and topo.hosts["far"].python == "/opt/disagg/.venv/bin/python"
    assert [i.name for i in topo.instances] == ["prefill[0]", "decode[0]"]


EMULATED = """\
model: disagg:tiny
link: {type: emulated, rate: 1gbit}
hosts:
  p: {address: 198.18.10.1}
  d: {address: 198.18.10.2}
roles:
  prefill: [{host: p, port: 8100}]
  decode: [{host: d, port: 8200}]
"""


def test_emulated_link_is_valid() -> None:
    topo = parse(EMULATED)
    assert topo.link.type == "emulated" and topo.link.rate_bps == 1e9


@pytest.mark.parametrize(("change", "message"), [
    (("198.18.10.1", "10.0.0.1"),
     "topo.yaml:4: hosts.p.address: 10.0.0.1 is not in 198.18.0.0/15 (the range emulated links use, "
     "e.g. 198.18.10.1 and 198.18.10.2)"),
    (("198.18.10.2", "198.18.11.2"),
     "topo.yaml:5: hosts.d.address: the prefill and decode hosts of an emulated link need two addresses in one "
     "/30, e.g. 198.18.10.1 and 198.18.10.2"),
    (("{host: d, port: 8200}", "{host: p, port: 8200}"),
     "topo.yaml:8: roles.decode[0].host: with an emulated link prefill and decode need different hosts"),
    (("198.18.10.1}", "198.18.10.1, ssh: me@p}"),
     "topo.yaml:4: hosts.p.ssh: emulated links run both hosts on this machine; remove ssh"),
])
def test_emulated_link_errors(change: tuple[str, str], message: str) -> None:
    assert error_of(EMULATED.replace(*change)) == message


REMOTE = GOOD.replace("b: {address: 127.0.0.1}", "b: {address: 127.0.0.1, ssh: SSH}")


@pytest.mark.parametrize(("ssh", "message"), [
    ("-oProxyCommand=touch /tmp/x", "'-oProxyCommand=touch /tmp/x' starts with '-', which ssh would read as an "
                                    "option; expected [user@]host"),
    ("'me@far -p 2'", "'me@far -p 2' contains whitespace or a control character; expected [user@]host"),
    ('"me@far\\t"', "'me@far\\t' contains whitespace or a control character; expected [user@]host"),
    ("''", "is empty; expected [user@]host"),
    ("[a, b]", "expected [user@]host, got a list"),
])
def test_ssh_destination_is_checked(ssh: str, message: str) -> None:
    assert error_of(REMOTE.replace("SSH", ssh)) == f"topo.yaml:7: hosts.b.ssh: {message}"


def test_a_plain_ssh_destination_is_kept() -> None:
    assert parse(REMOTE.replace("SSH", "me@far.lan")).hosts["b"].ssh == "me@far.lan"


@pytest.mark.parametrize(("env", "path", "message"), [
    ("{1X: a}", "1X", "'1X' is not a variable name (letters, digits and _, not starting with a digit)"),
    ("{A-B: a}", "A-B", "'A-B' is not a variable name (letters, digits and _, not starting with a digit)"),
    ("{'A B': a}", "A B", "'A B' is not a variable name (letters, digits and _, not starting with a digit)"),
    ("{'': a}", "", "'' is not a variable name (letters, digits and _, not starting with a digit)"),
    ('{A: "x\\ny"}', "A", "the value spans lines or holds a NUL character; environment values are one line"),
    ('{A: "x\\ry"}', "A", "the value spans lines or holds a NUL character; environment values are one line"),
    ("{A: [1]}", "A", "expected a string, got a list"),
])
def test_env_names_and_values_are_checked(env: str, path: str, message: str) -> None:
    msg = error_of(GOOD.replace("env: {FOO: bar}", f"env: {env}"))
    assert msg == f"topo.yaml:12: roles.decode[0].env.{path}: {message}"


def test_env_accepts_identifiers_and_scalars() -> None:
    topo = parse(GOOD.replace("env: {FOO: bar}", "env: {_A1: 1, b: true, C: 'x=y z'}"))
    assert dict(topo.role("decode")[0].env) == {"_A1": "1", "b": "true", "C": "x=y z"}


@pytest.mark.parametrize(("name", "problem"), [
    ("../escape", "contains a path separator (/ or \\)"),
    ("a\\\\b", "contains a path separator (/ or \\)"),
    ("'..'", "contains '..'"),
    ("'.'", "is '.'"),
    ("''", "is empty"),
    ('"a\\tb"', "contains a control or other non-printable character"),
])
def test_name_must_stay_in_the_run_directory(name: str, problem: str) -> None:
    msg = error_of("name: " + name + "\n" + GOOD)
    assert msg.startswith("topo.yaml:1: name: ") and problem in msg
    assert msg.endswith("; the name is the run directory <run_dir>/runs/<name>/, so it must be one plain "
                        "directory name")


def test_a_file_name_that_would_leave_the_run_directory_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "..yaml"
    path.write_text(GOOD)
    with pytest.raises(TopologyError) as info:
        load_topology(path)
    assert str(info.value).startswith(f"{path}:1: name: '.' is '.' (the file name '..yaml' without .yaml; set name:)")
    path.with_name("ok.yaml").write_text("name: fine-name\n" + GOOD)
    assert load_topology(path.with_name("ok.yaml")).name == "fine-name"


def test_ssh_limits_default_and_take_durations() -> None:
    assert (parse(GOOD).timeouts.ssh_command, parse(GOOD).timeouts.ssh_check) == (60.0, 20.0)
    topo = parse(GOOD + "timeouts: {ssh_command: 90, ssh_check: 500ms}\n")
    assert (topo.timeouts.ssh_command, topo.timeouts.ssh_check) == (90.0, 0.5)
    assert topo.timeouts.startup == 900.0


@pytest.mark.parametrize(("timeouts", "message"), [
    ("{ssh_check: 0}", "topo.yaml:13: timeouts.ssh_check: expected a duration greater than 0 and below 1e7 s, got 0"),
    ("{ssh_command: soon}",
     "topo.yaml:13: timeouts.ssh_command: expected a duration (seconds, or e.g. 30s, 10m), got the string 'soon'"),
    ("{ssh_comand: 30}", "topo.yaml:13: timeouts.ssh_comand: unknown field (did you mean 'ssh_command'?)"),
])
def test_ssh_limits_are_checked(timeouts: str, message: str) -> None:
    assert error_of(GOOD + f"timeouts: {timeouts}\n").startswith(message)
