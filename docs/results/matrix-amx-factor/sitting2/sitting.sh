#!/bin/bash
# Issue 15 confirmation sitting: replicas, socket auto (factor 1.25) and auto with factor 1.0 at 8 req/s,
# 12 repeats each in two interleaved blocks
# (A: seeds 8-13; B: seeds 14-19, reverse order), one engine set at a time under the engine lock.
LOG=/tmp/sF/sitting.log
COMMON="--classes short=64,long=512 --output-len 32 -n 120 --rates 8 --repeats 6 --slo ttft=2s,tpot=100ms"
run() {  # name dir topology routing seed
  echo "== $1 start $(date +%T) load $(cut -d' ' -f1-3 /proc/loadavg)" >> $LOG
  if [ "$4" = "-" ]; then R=""; else R="--routing $4"; fi
  (cd $2 && flock /tmp/disagg-engines.lock /work/main/.venv/bin/python -m disagg bench compare $3 $R $COMMON --seed $5 --out /tmp/sF/$1 > /tmp/sF/$1.out 2>&1)
  echo "== $1 end $(date +%T) rc=$? load $(cut -d' ' -f1-3 /proc/loadavg)" >> $LOG
}
M=/work/main; F=/work/wt-f1; S=/tmp/bench/emulated-1g-kvheavy-socket.yaml; RP=/tmp/bench/replicas-kvheavy.yaml
run A-replicas $M $RP - 8
run A-auto $M $S auto 8
run A-f1 $F $S auto 8
run B-f1 $F $S auto 14
run B-auto $M $S auto 14
run B-replicas $M $RP - 14
echo ALLDONE >> $LOG
