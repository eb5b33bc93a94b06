#!/bin/bash
# Issue 15 loopback sitting: colocated, replicas, socket auto, socket static split on the embedded
# tiny model (topologies/*.yaml; the socket 1P1D with proxy.log_level debug), issue 15's workload.
# Block A: rates 2,4,8,12, 3 repeats, seed 0; block B (reverse order): rates 8,12, 5 repeats, seed 3.
LOG=/tmp/sL/sitting.log
SLO="--classes short=128,long=2048 --output-len 32 -n 120 --slo ttft=250ms,tpot=25ms"
run() {  # name topology routing rates repeats seed
  echo "== $1 start $(date +%T) load $(cut -d' ' -f1-3 /proc/loadavg)" >> $LOG
  if [ "$3" = "-" ]; then R=""; else R="--routing $3"; fi
  (cd /work/main && flock /tmp/disagg-engines.lock .venv/bin/python -m disagg bench compare $2 $R $SLO \
      --rates $4 --repeats $5 --seed $6 --out /tmp/sL/$1 > /tmp/sL/$1.out 2>&1)
  echo "== $1 end $(date +%T) rc=$? load $(cut -d' ' -f1-3 /proc/loadavg)" >> $LOG
}
T=/work/main/topologies; S=/tmp/benchL/local-cpu-socket.yaml
run A-colocated $T/colocated.yaml - 2,4,8,12 3 0
run A-replicas $T/replicas.yaml - 2,4,8,12 3 0
run A-auto $S auto 2,4,8,12 3 0
run A-split $S split 2,4,8,12 3 0
run B-split $S split 8,12 5 3
run B-auto $S auto 8,12 5 3
run B-replicas $T/replicas.yaml - 8,12 5 3
echo ALLDONE >> $LOG
