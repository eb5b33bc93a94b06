#!/usr/bin/env bash
# One-shot GPU verification of the engine x connector rows that need a GPU:
#   1. SGLang 1P1D (Mooncake over TCP)   2. vLLM + LMCache 1P1D (NIXL)
#   3. vLLM + our socket connector 1P1D (CUDA caches through host staging)
# each through `disagg up --detach`, compared with a colocated run of the same
# engine (greedy outputs must be equal) and checked that KV moved (metrics).
#   3b. the same with streaming: true (each layer sent as the forward writes it,
#   after a CUDA event on the cache: the GPU path of streams.py)
#   4. vLLM + socket connector with wire_format fp8 (lossy, opt-in): the same
# checks, but instead of equality an accuracy report on the real model: greedy
# match rate, tokens in common, log-prob drift (verify_run.py accuracy).
#
# Usage (single-GPU machine, a small model already on local disk):
#   benchmarks/gpu/verify.sh /models/Qwen2.5-0.5B-Instruct
# Env: VERIFY_WORK (venvs, topologies, logs; default .disagg/gpu-verify),
#      VERIFY_MOONCAKE (default mooncake-transfer-engine-cuda13; -cuda12 stacks:
#      mooncake-transfer-engine),
#      VERIFY_BUDGET_S (default 480), SKIP_INSTALL=1 (reuse the venvs as they are).
# Exits non-zero on any failure; everything it started is taken down.
set -euo pipefail

MODEL=${1:?usage: $0 /path/to/small/local/model}
MODEL=$(cd "$MODEL" && pwd)
REPO=$(cd "$(dirname "$0")/../.." && pwd)
WORK=${VERIFY_WORK:-$REPO/.disagg/gpu-verify}
BUDGET=${VERIFY_BUDGET_S:-480}
HELPER=$REPO/benchmarks/gpu/verify_run.py
mkdir -p "$WORK"
CURRENT=""     # "python|topology" currently up, for the exit trap

log() { printf '[verify %4ds] %s\n' "$SECONDS" "$*"; }
fail() { log "FAIL: $*"; exit 1; }
remaining() { echo $((BUDGET - SECONDS)); }

cleanup() {
  if [ -n "$CURRENT" ]; then
    PYTHONPATH=$REPO "${CURRENT%%|*}" -m disagg down "${CURRENT##*|}" >/dev/null 2>&1 || true
  fi
}
trap cleanup EXIT

command -v nvidia-smi >/dev/null && nvidia-smi -L | grep -q GPU || fail "no NVIDIA GPU visible (nvidia-smi -L)"
ldconfig -p | grep -q libibverbs.so.1 || fail "Mooncake needs libibverbs1 (apt-get install libibverbs1), even for TCP"

# --- 1. packages: one venv per engine (sglang and lmcache pin different grpcio)
install() {
  local venv=$1; shift
  [ -x "$venv/bin/python" ] || python3 -m venv "$venv"
  "$venv/bin/pip" install -q --upgrade pip >/dev/null
  "$venv/bin/pip" install -q "$@"
}
if [ "${SKIP_INSTALL:-0}" != 1 ]; then
  log "installing sglang (+mooncake) and vllm (+lmcache, nixl) into $WORK/venv-*"
  # sglang 0.5.x brings torch for CUDA 13; Mooncake's matching wheel is the -cuda13 one
  install "$WORK/venv-sglang" sglang "${VERIFY_MOONCAKE:-mooncake-transfer-engine-cuda13}" \
    > "$WORK/install-sglang.log" 2>&1 & a=$!
  install "$WORK/venv-vllm" vllm lmcache nixl > "$WORK/install-vllm.log" 2>&1 & b=$!
  wait $a || fail "pip install sglang failed: $(tail -3 "$WORK/install-sglang.log")"
  wait $b || fail "pip install vllm lmcache failed: $(tail -3 "$WORK/install-vllm.log")"
  # the engines import disagg_connectors (socket connector, engine guard): this checkout, no deps
  "$WORK/venv-vllm/bin/pip" install -q --no-deps -e "$REPO" >> "$WORK/install-vllm.log" 2>&1 \
    || fail "pip install -e $REPO failed: $(tail -3 "$WORK/install-vllm.log")"
fi

# --- 2. topologies: colocated reference and 1P1D, from topologies/*-1p1d.yaml
topology() {  # name engine connector python roles-yaml extra-args
  cat > "$WORK/$1.yaml" <<EOF
name: $1
run_dir: $WORK/run
model: {path: $MODEL, dtype: bfloat16, max_model_len: 4096}
engine: $2
connector: $3
link: {type: loopback}
proxy: {host: 127.0.0.1, port: 8000}
hosts:
  gpu: {address: 127.0.0.1, device: cuda, python: $4}
roles:
$5
timeouts: {startup: 400}
EOF
  echo "$WORK/$1.yaml"
}

up() {  # python topology
  local n
  n=$(remaining)
  [ "$n" -gt 30 ] || fail "out of time before $(basename "$2") (budget ${BUDGET}s)"
  log "up $(basename "$2")"
  CURRENT="$1|$2"
  PYTHONPATH=$REPO timeout "$n" "$1" -m disagg up "$2" --detach > "$2.up.log" 2>&1 \
    || fail "disagg up $2: $(tail -20 "$2.up.log")"
}

down() {  # python topology
  PYTHONPATH=$REPO "$1" -m disagg down "$2" >/dev/null || fail "disagg down $2"
  CURRENT=""
}

verify() {  # label engine connector python both-args pd-roles [check: compare | accuracy]
  local label=$1 engine=$2 connector=$3 py=$4 check=${7:-compare} colo pd
  colo=$(topology "$label-colocated" "$engine" "$connector" "$py" "  both:
    - {host: gpu, port: 8300, gpus: [0], args: $5}")
  pd=$(topology "$label-1p1d" "$engine" "$connector" "$py" "$6")
  PYTHONPATH=$REPO "$py" -m disagg check "$pd" > "$pd.plan.txt" || fail "disagg check $pd"
  up "$py" "$colo"
  "$py" "$HELPER" generate http://127.0.0.1:8000 "$MODEL" "$WORK/$label-colocated.json" || fail "$label colocated requests"
  down "$py" "$colo"
  up "$py" "$pd"
  "$py" "$HELPER" generate http://127.0.0.1:8000 "$MODEL" "$WORK/$label-1p1d.json" || fail "$label 1P1D requests"
  "$py" "$HELPER" kv-moved "$engine" http://127.0.0.1:8100 http://127.0.0.1:8200 || fail "$label: no KV moved"
  down "$py" "$pd"
  "$py" "$HELPER" "$check" "$WORK/$label-colocated.json" "$WORK/$label-1p1d.json" \
    | tee "$WORK/$label-$check.txt" || fail "$label: $check"
  log "$label: PASS"
}

SG=$WORK/venv-sglang/bin/python
VL=$WORK/venv-vllm/bin/python

verify sglang sglang mooncake "$SG" '[--mem-fraction-static, "0.8"]' "  prefill:
    - {host: gpu, port: 8100, kv_port: 8998, gpus: [0], args: [--mem-fraction-static, \"0.4\"]}
  decode:
    - {host: gpu, port: 8200, gpus: [0], args: [--mem-fraction-static, \"0.4\"]}"

verify lmcache vllm lmcache "$VL" '[--gpu-memory-utilization, "0.8", --enforce-eager]' "  prefill:
    - {host: gpu, port: 8100, gpus: [0], args: [--gpu-memory-utilization, \"0.4\", --enforce-eager]}
  decode:
    - {host: gpu, port: 8200, kv_port: 7300, gpus: [0], args: [--gpu-memory-utilization, \"0.4\", --enforce-eager]}"

SOCKET_PD="  prefill:
    - {host: gpu, port: 8100, kv_port: 7400, gpus: [0], args: [--gpu-memory-utilization, \"0.4\", --enforce-eager]}
  decode:
    - {host: gpu, port: 8200, gpus: [0], args: [--gpu-memory-utilization, \"0.4\", --enforce-eager]}
routing: {policy: split}"
verify socket vllm socket "$VL" '[--gpu-memory-utilization, "0.8", --enforce-eager]' "$SOCKET_PD"
verify socket-stream vllm "{type: socket, streaming: true}" "$VL" '[--gpu-memory-utilization, "0.8", --enforce-eager]' \
  "$SOCKET_PD"
verify socket-fp8 vllm "{type: socket, wire_format: fp8}" "$VL" '[--gpu-memory-utilization, "0.8", --enforce-eager]' \
  "$SOCKET_PD" accuracy

log "ALL PASS (SGLang 1P1D, vLLM+LMCache 1P1D, vLLM+socket 1P1D fetched and streamed; fp8 accuracy in $WORK/socket-fp8-accuracy.txt)" \
  "in ${SECONDS}s"
