#!/bin/bash
# Issue 15 sitting: replicas, socket auto (main, WHOLE_TPOT_FACTOR 1.25), socket auto with factor 1.0
# (worktree /work/wt-f1), socket split; 6 and 8 req/s; 8 repeats each in two interleaved blocks
# (A: seeds 0-3; B: seeds 4-7, reverse order), one engine set at a time under the engine lock.
LOG=/tmp/sE/sitting.log
COMMON="--classes short=64,long=512 --output-len 32 -n 120 --rates 6,8 --repeats 4 --slo ttft=2s,tpot=100ms"
run() {  # name dir topology routing seed
  echo "== $1 start $(date +%T) load $(cut -d' ' -f1-3 /proc/loadavg)" >> $LOG
  if [ "$4" = "-" ]; then R=""; else R="--routing $4"; fi
  (cd $2 && flock /tmp/disagg-engines.lock /work/main/.venv/bin/python -m disagg bench compare $3 $R $COMMON --seed $5 --out /tmp/sE/$1 > /tmp/sE/$1.out 2>&1)
  echo "== $1 end $(date +%T) rc=$? load $(cut -d' ' -f1-3 /proc/loadavg)" >> $LOG
}
M=/work/main; F=/work/wt-f1; S=/tmp/bench/emulated-1g-kvheavy-socket.yaml; RP=/tmp/bench/replicas-kvheavy.yaml
run A-replicas $M $RP - 0
run A-auto $M $S auto 0
run A-f1 $F $S auto 0
run A-split $M $S split 0
run B-split $M $S split 4
run B-f1 $F $S auto 4
run B-auto $M $S auto 4
run B-replicas $M $RP - 4
echo ALLDONE >> $LOG
