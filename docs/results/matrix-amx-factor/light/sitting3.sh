#!/bin/bash
# Emulated 1 Gb/s link, KV-heavy model, socket 1P1D auto (current code) with the replica pool beside it,
# light load: 2 and 4 req/s, 3 repeats, seed 0 (the workload of docs/results.md's emulated sittings).
LOG=/tmp/sL/sitting3.log
C="--classes short=64,long=512 --output-len 32 -n 120 --rates 2,4 --repeats 3 --slo ttft=2s,tpot=100ms --seed 0"
run() {
  echo "== $1 start $(date +%T) load $(cut -d' ' -f1-3 /proc/loadavg)" >> $LOG
  (cd /work/main && flock /tmp/disagg-engines.lock .venv/bin/python -m disagg bench compare $2 $3 $C --out /tmp/sL/$1 > /tmp/sL/$1.out 2>&1)
  echo "== $1 end $(date +%T) rc=$? load $(cut -d' ' -f1-3 /proc/loadavg)" >> $LOG
}
run E-replicas /tmp/bench/replicas-kvheavy.yaml ""
run E-auto /tmp/bench/emulated-1g-kvheavy-socket.yaml "--routing auto"
echo ALLDONE >> $LOG
