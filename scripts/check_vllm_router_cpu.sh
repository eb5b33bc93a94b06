#!/usr/bin/env bash
# vllm-router (PyPI) as the front door of real vLLM 1P1D on this CPU machine:
# topologies/local-cpu-nixl.yaml with proxy.kind vllm-router, on other ports, through
# `disagg up --detach`; greedy completions through the router must equal decode
# alone, and decode's NIXL transfer count must grow. Holds the engine lock; takes
# everything down on exit.   Usage: scripts/check_vllm_router_cpu.sh [PYTHON]
set -euo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
PY=${1:-$REPO/.venv/bin/python}
WORK=$(mktemp -d /tmp/disagg-vllm-router.XXXX)
T=$WORK/router-cpu.yaml
sed -e 's/port: 8000}/port: 8690, kind: vllm-router}/' \
    -e 's/port: 8100, kv_port: 5601/port: 8610, kv_port: 5681/' \
    -e 's/port: 8200, kv_port: 5602/port: 8620, kv_port: 5682/' \
    -e "s|^model:|name: vllm-router-cpu\nrun_dir: $WORK/run\nmodel:|" "$REPO/topologies/local-cpu-nixl.yaml" > "$T"
export PYTHONPATH=$REPO
exec 9>/tmp/disagg-engines.lock
flock 9
trap '"$PY" -m disagg down "$T" || true' EXIT
"$PY" -m disagg up "$T" --detach
BODY='{"model":"tiny","prompt":"The quick brown fox","max_tokens":8,"temperature":0}'
xfers() { curl -s http://127.0.0.1:8620/metrics | awk '/^vllm:nixl_xfer_time_seconds_count/ {s+=$2} END {print s+0}'; }
before=$(xfers)
via_router=$(curl -sf -m 120 http://127.0.0.1:8690/v1/completions -H 'Content-Type: application/json' -d "$BODY" \
  | "$PY" -c 'import json,sys; print(json.load(sys.stdin)["choices"][0]["text"])')
after=$(xfers)
alone=$(curl -sf -m 120 http://127.0.0.1:8620/v1/completions -H 'Content-Type: application/json' -d "$BODY" \
  | "$PY" -c 'import json,sys; print(json.load(sys.stdin)["choices"][0]["text"])')
echo "via vllm-router: ${via_router@Q}  decode alone: ${alone@Q}  NIXL transfers on decode: $before -> $after"
[ "$via_router" = "$alone" ] && [ "$after" -gt "$before" ] && echo PASS
