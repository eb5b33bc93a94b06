"""The docs stay true to the tree: links resolve, every module is listed, samples match the code.

No engines: the samples checked here are what `disagg check` and `disagg plan` print, produced
in-process. (docs/topology.md's examples have checks of their own next to the code that reads them.)
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from disagg.cli import main

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
PAGES = [*sorted(DOCS.rglob("*.md")), ROOT / "README.md"]

#: a Markdown link or image target: [text](target) / ![alt](target)
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^\s*```")


def _prose(text: str) -> str:
    """``text`` without its fenced code blocks (their brackets are code, not links)."""
    out, inside = [], False
    for line in text.splitlines():
        if FENCE.match(line):
            inside = not inside
            continue
        out.append("" if inside else line)
    return "\n".join(out)


def _anchors(page: Path) -> set[str]:
    """GitHub's anchors for a page's headings: lowercased, punctuation dropped, spaces -> '-', repeats numbered."""
    seen: dict[str, int] = {}
    anchors = set()
    for line in _prose(page.read_text()).splitlines():
        heading = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not heading:
            continue
        slug = re.sub(r"[^\w\- ]", "", heading.group(1).lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        anchors.add(slug if count == 0 else f"{slug}-{count}")
    return anchors


def _links(page: Path) -> list[str]:
    return [t for t in LINK.findall(_prose(page.read_text()))
            if not re.match(r"[a-z][a-z0-9+.-]*:", t)]   # http:, https:, mailto: are not checked here


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_every_relative_link_resolves(page: Path) -> None:
    broken = []
    for target in _links(page):
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target}: no {dest.relative_to(ROOT) if dest.is_relative_to(ROOT) else dest}")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(f"{target}: no heading with anchor #{anchor} in {dest.name}")
    assert not broken, f"{page.relative_to(ROOT)}:\n" + "\n".join(broken)


def _tracked(*paths: str) -> list[Path]:
    out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "--", *paths],
                         cwd=ROOT, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        pytest.skip("not a git checkout")
    return [ROOT / line for line in out.stdout.splitlines() if (ROOT / line).exists()]


def test_docs_hold_no_scripts_and_stay_small() -> None:
    files = _tracked("docs")
    scripts = [str(p.relative_to(ROOT)) for p in files if p.suffix in {".py", ".sh"}]
    assert not scripts, f"scripts belong in benchmarks/ or scripts/, not docs/: {scripts}"
    size = sum(p.stat().st_size for p in files)
    assert size < 3_000_000, f"docs/ holds {size / 1e6:.1f} MB; keep only what the pages cite (git keeps history)"


def test_architecture_lists_every_module() -> None:
    listed = (DOCS / "architecture.md").read_text()
    missing = []
    for package in ("disagg", "connectors"):
        for path in _tracked(package):
            if path.suffix != ".py":
                continue
            module = path.relative_to(ROOT / package).as_posix()
            if module in {"engines/__init__.py", "kv/__init__.py", "launch/__init__.py"}:
                continue   # empty, and said so
            if f"`{module}`" not in listed:
                missing.append(f"{package}/{module}")
    assert not missing, "docs/architecture.md's module tables lack: " + ", ".join(missing)


#: a tracker's issue number: "issue 13", "issues 13/14", "#14" (not an upstream "owner/repo#N" nor a colour)
ISSUE = re.compile(r"\bissues?\s+#?\d+|(?<![\w/&])#\d{1,6}\b", re.IGNORECASE)


def test_no_tracker_issue_numbers() -> None:
    """The tracker is not in the repository: say what a figure or a case is, not which issue asked for it."""
    found = []
    for path in _tracked("disagg", "connectors", "tests", "benchmarks", "scripts", "docs", "README.md", "Makefile"):
        if path.suffix not in {".py", ".md", ".sh", ".yaml", ".toml", ""} or path == Path(__file__):
            continue
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if "vllm-project/" in line:   # upstream's tracker, named as such
                continue
            if ISSUE.search(line):
                found.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()[:100]}")
    assert not found, "\n".join(found)


# ---- samples: what a page shows, against what the code produces


def _check(topology: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv("DISAGG_KV_SECRET", "0" * 64)
    assert main(["check", str(ROOT / "topologies" / topology)]) == 0
    return capsys.readouterr().out


def _kv_config(out: str, instance: str) -> dict[str, Any]:
    """The --kv-transfer-config of ``instance``'s argv in `disagg check`'s output."""
    lines = out.splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.strip().startswith(f"{instance}:"))
    argv_line = next(ln for ln in lines[start:] if ln.strip().startswith("argv:"))
    argv = shlex.split(argv_line.split("argv:", 1)[1])
    config: dict[str, Any] = json.loads(argv[argv.index("--kv-transfer-config") + 1])
    return config


def _sample_block(page: str, after: str) -> str:
    text = (DOCS / page).read_text()
    start = text.index(after)
    block = re.search(r"```[^\n]*\n(.*?)```", text[start:], re.DOTALL)
    assert block, f"no code block after {after!r} in {page}"
    return block.group(1)


#: a placeholder of a documented sample: any value matches
MARKER = "\x00"


def _template(text: str) -> Any:
    """A documented JSON sample with ``<placeholders>`` and ``...`` list tails, as JSON with markers."""
    marker = json.dumps(MARKER)
    text = re.sub(r'"<[^">]*>(:<[^">]*>)?"', lambda _: marker, text)   # "<host.address>", "<P host>:<P kv_port>"
    text = re.sub(r"<[^>]*>", lambda _: marker, text)                  # <kv_port>
    text = re.sub(r",\s*\.\.\.\s*\]", "]", text)                  # [..., ...] -> the listed items only
    return json.loads(text)


def _matches(doc: Any, real: Any, where: str = "") -> list[str]:
    """Differences between a documented template and a real value: keys, literals, list items."""
    if doc == MARKER:
        return []
    if isinstance(doc, dict):
        if not isinstance(real, dict):
            return [f"{where}: documented an object, the plan has {real!r}"]
        diff = [f"{where}.{k}: documented, not planned" for k in doc.keys() - real.keys()]
        diff += [f"{where}.{k}: planned, not documented" for k in real.keys() - doc.keys()]
        for k in doc.keys() & real.keys():
            diff += _matches(doc[k], real[k], f"{where}.{k}")
        return diff
    if isinstance(doc, list):
        if not isinstance(real, list) or len(real) < len(doc):
            return [f"{where}: documented {doc!r}, the plan has {real!r}"]
        return [d for i, item in enumerate(doc) for d in _matches(item, real[i], f"{where}[{i}]")]
    return [] if doc == real else [f"{where}: documented {doc!r}, the plan has {real!r}"]


def test_socket_connector_sample_is_what_check_plans(capsys: pytest.CaptureFixture[str],
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """docs/socket-connector.md, "Using it": each side's --kv-transfer-config."""
    block = _sample_block("socket-connector.md", "## Using it")
    sides = dict(re.findall(r"^([PD]): --kv-transfer-config '(.*?)'$", block, re.DOTALL | re.MULTILINE))
    assert set(sides) == {"P", "D"}
    out = _check("local-cpu.yaml", capsys, monkeypatch)
    diff = (_matches(_template(sides["P"]), _kv_config(out, "prefill[0]"), "P")
            + _matches(_template(sides["D"]), _kv_config(out, "decode[0]"), "D"))
    assert not diff, "docs/socket-connector.md's sample drifted:\n" + "\n".join(diff)
    assert "env (both): DISAGG_KV_SECRET=" in block


def test_lmcache_sample_is_what_check_plans(capsys: pytest.CaptureFixture[str],
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """docs/engines.md, LMCache: the connector settings each side gets."""
    text = (DOCS / "engines.md").read_text()
    section = text[text.index("## LMCache"):]
    assert '"kv_connector":"LMCacheConnectorV1"' in section
    assert '{"discard_partial_chunks":false,"lmcache_rpc_port":"disagg-<topology>-<role><i>"}' in section
    assert 'decode adding `"skip_last_n_tokens":1`' in section
    out = _check("lmcache-1p1d.yaml", capsys, monkeypatch)
    prefill, decode = _kv_config(out, "prefill[0]"), _kv_config(out, "decode[0]")
    assert (prefill["kv_connector"], prefill["kv_role"]) == ("LMCacheConnectorV1", "kv_producer")
    assert (decode["kv_connector"], decode["kv_role"]) == ("LMCacheConnectorV1", "kv_consumer")
    assert prefill["kv_connector_extra_config"] == {"discard_partial_chunks": False,
                                                    "lmcache_rpc_port": "disagg-lmcache-1p1d-prefill0"}
    assert decode["kv_connector_extra_config"] == {"discard_partial_chunks": False,
                                                   "lmcache_rpc_port": "disagg-lmcache-1p1d-decode0",
                                                   "skip_last_n_tokens": 1}


@pytest.mark.parametrize(("after", "argv"), [
    ("## What `disagg plan` prints", []),
    ("`disagg plan topologies/house-2g5.yaml --classes", ["--classes", "short=128:32@0.7,long=2048:256@0.3",
                                                           "--rate", "4", "--slo", "ttft=1s,tpot=50ms"]),
])
def test_the_plan_samples_are_what_plan_prints(after: str, argv: list[str], tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str],
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """docs/the-one-question.md: `disagg plan`'s verdict table and workload plan for the GPU house, as
    the code prints them now (from a directory with no measurements or link probe stored)."""
    (tmp_path / "topologies").mkdir()
    shutil.copy(ROOT / "topologies" / "house-2g5.yaml", tmp_path / "topologies")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf"))     # the built-in table, not a cached config.json
    block = _sample_block("the-one-question.md", after)
    assert main(["plan", "topologies/house-2g5.yaml", "--no-probe", *argv]) == 0
    out = capsys.readouterr().out
    drift = [f"line {n}: documented {d!r}\n         printed    {o!r}"
             for n, (d, o) in enumerate(zip(block.splitlines(), out.splitlines(), strict=False), 1) if d != o]
    assert out == block, "docs/the-one-question.md's sample drifted (rerun the command there):\n" + "\n".join(
        drift[:10] or [f"{len(block.splitlines())} lines documented, {len(out.splitlines())} printed"])
