#!/usr/bin/env bash
# The checks that need SGLang's and LMCache's own code, without their heavy
# installs: each package goes, with --no-deps, into a small side directory
# (.disagg/pkgcheck/NAME) holding only that package plus the few pure-Python
# modules its config parser imports that .venv lacks. The checks run with .venv's
# Python and PYTHONPATH=SIDE_DIR:$PWD, so they reuse .venv's torch, numpy,
# transformers, ... and .venv itself is never modified (nothing installed in
# .venv may also be in a side directory; checked after each install).
#
# Runs per package: its unit tests (every one must pass; a skip fails the run,
# since the parser test skips only when the package is missing) and
# scripts/check_engine_configs.py on its example topology. Idempotent: a stamp
# file skips the install when the pins did not change. VENV overrides .venv.
set -euo pipefail
cd "$(dirname "$0")/.."

venv=${VENV:-.venv}
py=$venv/bin/python
root=.disagg/pkgcheck

# Pins: the engine package + what its parser imports beyond .venv (found by trying).
declare -A REQS=(
    [sglang]="sglang==0.5.23 ipython==9.18.1 traitlets==5.16.1 orjson==3.13.0"  # sglang.utils: IPython; srt.utils: orjson
    [lmcache]="lmcache==0.5.6"
)
declare -A TESTS=(
    [sglang]=tests/unit/engines/test_sglang.py
    [lmcache]=tests/unit/kv/test_lmcache.py
)
declare -A TOPOLOGIES=(
    [sglang]=topologies/sglang-1p1d.yaml
    [lmcache]=topologies/lmcache-1p1d.yaml
)

log() { echo "engine-package-checks: $*" >&2; }

# Install NAME's pins into its side directory unless its stamp says they are there.
build() {
    local name=$1 dir=$root/$1
    local want
    # .venv's own install stamp too: a changed .venv re-runs the shadowing check.
    want="${REQS[$name]} python=$("$py" -c 'import sys; print(sys.version.split()[0])')"
    want="$want venv=$(cat "$venv/.disagg-install-stamp" 2>/dev/null || true)"
    if [ -f "$dir/.stamp" ] && [ "$(cat "$dir/.stamp")" = "$want" ]; then
        return 0
    fi
    log "installing ${REQS[$name]} into $dir (--no-deps)"
    local start=$SECONDS
    rm -rf "$dir"
    # shellcheck disable=SC2086  # REQS holds several requirements
    "$py" -m pip install --quiet --disable-pip-version-check --no-deps --no-compile \
        --only-binary :all: --target "$dir" ${REQS[$name]}
    # A side package that .venv also has would shadow .venv's copy in the checks.
    "$py" - "$dir" <<'EOF'
import importlib.metadata as md
import sys

side = sys.argv[1]
clash = []
for dist in md.distributions(path=[side]):
    try:
        clash.append(f"{dist.metadata['Name']} (.venv has {md.version(dist.metadata['Name'])})")
    except md.PackageNotFoundError:
        pass
if clash:
    sys.exit(f"engine-package-checks: {side} would shadow .venv's packages: {', '.join(clash)}")
EOF
    echo "$want" > "$dir/.stamp"
    log "$name: installed in $((SECONDS - start)) s, $(du -sm "$dir" | cut -f1) MB"
}

# Run NAME's unit tests and the parser check on its topology in its side directory.
check() {
    local name=$1 dir=$root/$1
    local report=$dir/.pytest.xml
    log "$name: ${TESTS[$name]}"
    PYTHONPATH="$dir:$PWD" "$py" -m pytest -q -p no:cacheprovider -rs --junitxml="$report" "${TESTS[$name]}"
    "$py" - "$report" "$name" <<'EOF'
import sys
import xml.etree.ElementTree as ET

report, name = sys.argv[1], sys.argv[2]
suite = ET.parse(report).getroot()
suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
tests, skipped = int(suite.get("tests", 0)), int(suite.get("skipped", 0))
if tests == 0 or skipped:
    sys.exit(f"engine-package-checks: {name}: {tests} tests ran, {skipped} skipped; "
             f"with {name} on the path none may skip")
EOF
    log "$name: scripts/check_engine_configs.py ${TOPOLOGIES[$name]}"
    PYTHONPATH="$dir:$PWD" LMCACHE_LOG_LEVEL=WARNING "$py" scripts/check_engine_configs.py "${TOPOLOGIES[$name]}"
}

[ -x "$py" ] || { log "no $py (run scripts/install.sh first)"; exit 1; }
for name in sglang lmcache; do
    build "$name"
done
for name in sglang lmcache; do
    check "$name"
done
log "all passed"
