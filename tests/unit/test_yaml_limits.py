"""Loading a topology file is bounded: billion laughs, recursive aliases, deep nesting
and huge files are refused fast with file:line, and ordinary aliases still work."""

from __future__ import annotations

import textwrap
import time
from pathlib import Path

import pytest

from disagg.cli import main
from disagg.errors import TopologyError
from disagg.topology import load_topology, parse_topology
from disagg.yamlsrc import MAX_ALIAS_USES, MAX_DEPTH, MAX_FILE_BYTES, load_yaml, parse_yaml

#: the classic "billion laughs": 9 levels of 9 aliases, 9^9 = 387 million strings once expanded
BILLION_LAUGHS = "".join(
    ['a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]\n']
    + [f"{n}: &{n} [{','.join(['*' + p] * 9)}]\n" for p, n in zip("abcdefgh", "bcdefghi", strict=True)])


def _refusal(path: Path) -> tuple[str, float]:
    """The refusal's message and the CPU time it took (not wall time: a busy machine may deschedule us)."""
    started = time.process_time()
    with pytest.raises(TopologyError) as info:
        load_yaml(path)
    return str(info.value), time.process_time() - started


def test_billion_laughs_is_refused_in_well_under_a_second(tmp_path: Path) -> None:
    path = tmp_path / "lol.yaml"
    path.write_text(BILLION_LAUGHS)
    assert len(BILLION_LAUGHS) < 700
    message, seconds = _refusal(path)
    assert seconds < 1.0, f"took {seconds:.2f} s"
    # the alias that crossed the cap, on its own line (the third *b alias use line is c's)
    assert message.startswith(f"{path}:3: ")
    assert f"aliases expand more than {MAX_ALIAS_USES} times" in message and "billion laughs" in message


def test_billion_laughs_through_the_cli_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "lol.yaml"
    path.write_text(BILLION_LAUGHS)
    started = time.perf_counter()
    assert main(["check", str(path)]) == 2
    # expanded, these aliases would take minutes and gigabytes; refused, milliseconds (a loose bound:
    # the machine may be busy with engines)
    assert time.perf_counter() - started < 10.0
    err = capsys.readouterr().err
    assert err.startswith(f"disagg: error: {path}:3: ") and "Traceback" not in err


@pytest.mark.parametrize(("text", "line", "path"), [
    ("name: &a [*a]\n", 1, "name[0]"),
    ("model: x\nhosts: &h\n  a: {address: 127.0.0.1}\n  b: *h\n", 4, "hosts.b"),
    ("a: &a\n  - x\n  - [1, [2, *a]]\n", 3, "a[1][1][1]"),
])
def test_recursive_alias_is_refused_with_its_line(text: str, line: int, path: str) -> None:
    started = time.process_time()         # CPU time: a busy machine may deschedule us
    with pytest.raises(TopologyError) as info:
        parse_yaml(text, "rec.yaml")
    assert time.process_time() - started < 1.0
    assert str(info.value) == (f"rec.yaml:{line}: {path}: alias *{'h' if 'hosts' in text else 'a'} refers to a "
                               "value that contains it (a recursive alias)")


def test_a_file_over_the_size_cap_is_refused_before_parsing(tmp_path: Path) -> None:
    path = tmp_path / "huge.yaml"
    line = "k: " + "x" * 96 + "\n"   # 100 bytes
    lines = 3 * MAX_FILE_BYTES // len(line)
    path.write_text(line * lines)    # 3 MiB
    message, seconds = _refusal(path)
    assert seconds < 0.5, f"took {seconds:.2f} s"
    crossing = MAX_FILE_BYTES // len(line) + 1  # the line on which the file passes 1 MiB
    assert message == (f"{path}:{crossing}: the file passes 1 MiB here, the limit for a topology file "
                       "(a topology is a few KB)")


def test_an_endless_file_is_refused(tmp_path: Path) -> None:
    """/dev/zero stands for a file that never ends: only the first MiB + 1 byte is read."""
    message, seconds = _refusal(Path("/dev/zero"))
    assert seconds < 0.5 and message.startswith("/dev/zero:1: the file passes 1 MiB here")


def test_text_over_the_size_cap_is_refused() -> None:
    with pytest.raises(TopologyError, match=r"^t.yaml:1: the file passes 1 MiB here"):
        parse_yaml("#" * (MAX_FILE_BYTES + 1), "t.yaml")


def test_deep_nesting_is_refused_with_its_line() -> None:
    text = "a: 1\nb: " + "[" * (MAX_DEPTH + 5) + "]" * (MAX_DEPTH + 5) + "\n"
    with pytest.raises(TopologyError) as info:
        parse_yaml(text, "deep.yaml")
    assert str(info.value) == f"deep.yaml:2: nested deeper than {MAX_DEPTH} levels"


def test_deep_block_nesting_is_refused_without_a_traceback() -> None:
    with pytest.raises(TopologyError, match=r"^deep.yaml:1: "):
        parse_yaml("- " * 5000 + "x\n", "deep.yaml")


def test_aliases_nesting_past_the_depth_cap_are_refused() -> None:
    """Each level below is shallow where it is written; only the expansion is deep."""
    text = "l0: &l0 [x]\n" + "".join(f"l{i}: &l{i} [[[[*l{i - 1}]]]]\n" for i in range(1, 20))
    with pytest.raises(TopologyError, match=f"aliases nest values deeper than {MAX_DEPTH} levels"):
        parse_yaml(text, "d.yaml")


def test_invalid_utf8_names_its_line(tmp_path: Path) -> None:
    path = tmp_path / "bin.yaml"
    path.write_bytes(b"model: x\nname: \xff\xfe\n")
    message, _ = _refusal(path)
    assert message == f"{path}:2: not UTF-8 text (byte 15: invalid start byte)"


def test_undefined_alias_names_its_line() -> None:
    with pytest.raises(TopologyError) as info:
        parse_yaml("a: 1\nb: *nope\n", "u.yaml")
    assert str(info.value) == "u.yaml:2: invalid YAML: found undefined alias 'nope'"


def test_ordinary_aliases_still_work() -> None:
    topo = parse_topology(textwrap.dedent("""\
        model: disagg:tiny
        hosts: {a: {address: 127.0.0.1}}
        roles:
          prefill: [{port: 8100, env: &env {VLLM_CPU_KVCACHE_SPACE: "2", X: &one "1"}}]
          decode: [{port: 8200, env: *env, args: [--max-num-seqs, *one]}]
        """), "ok.yaml", run_dir="/tmp/run")
    decode = topo.role("decode")[0]
    assert dict(decode.env) == {"VLLM_CPU_KVCACHE_SPACE": "2", "X": "1"} == dict(topo.role("prefill")[0].env)
    assert decode.args == ("--max-num-seqs", "1")


def test_an_alias_as_a_key_is_read() -> None:
    node = parse_yaml("k: &k name\n*k : 2\n", "k.yaml")
    assert node.value == {"k": "name", "name": 2}
    assert node.children["name"].line == 2


def test_a_mapping_key_is_refused() -> None:
    with pytest.raises(TopologyError) as info:
        parse_yaml("? [a, b]\n: 1\n", "k.yaml")
    assert str(info.value) == "k.yaml:1: <top>: keys must be strings, got a list"


def test_the_repository_topologies_still_load() -> None:
    root = Path(__file__).resolve().parents[2] / "topologies"
    files = sorted(root.glob("*.yaml"))
    assert files
    for path in files:
        assert load_topology(path).name
