#!/bin/bash
# Issue 15 loopback sitting, part 2: the NIXL 1P1D (topologies/local-cpu.yaml, proxy.log_level debug)
# auto and static split with the replica pool beside it, block A's workload (rates 2,4,8,12, 3 repeats, seed 0).
LOG=/tmp/sL/sitting2.log
SLO="--classes short=128,long=2048 --output-len 32 -n 120 --slo ttft=250ms,tpot=25ms"
run() {  # name topology routing rates repeats seed
  echo "== $1 start $(date +%T) load $(cut -d' ' -f1-3 /proc/loadavg)" >> $LOG
  if [ "$3" = "-" ]; then R=""; else R="--routing $3"; fi
  (cd /work/main && flock /tmp/disagg-engines.lock .venv/bin/python -m disagg bench compare $2 $R $SLO \
      --rates $4 --repeats $5 --seed $6 --out /tmp/sL/$1 > /tmp/sL/$1.out 2>&1)
  echo "== $1 end $(date +%T) rc=$? load $(cut -d' ' -f1-3 /proc/loadavg)" >> $LOG
}
T=/work/main/topologies; N=/tmp/benchL/local-cpu.yaml
run N-replicas $T/replicas.yaml - 2,4,8,12 3 0
run N-auto $N auto 2,4,8,12 3 0
run N-split $N split 2,4,8,12 3 0
echo ALLDONE >> $LOG
