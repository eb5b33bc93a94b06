"""Merge the loopback sitting's blocks per label into one report in /tmp/sL/all: rates 2 and 4 from
block A (3 repeats, seed 0); rates 8 and 12 from A then B (3 + 5 repeats, seeds 0 and 3), repeats
renumbered 0-7. Colocated ran in block A only."""
import shutil
from pathlib import Path
from disagg.bench.report import load_json, write_json, write_report
root = Path("/tmp/sL"); out = root / "all"; (out / "logs").mkdir(parents=True, exist_ok=True)
doc = {}
for cfg in ("colocated", "replicas", "auto", "split"):
    blocks = [(b, load_json(root / f"{b}-{cfg}" / "results.json")) for b in "AB" if (root / f"{b}-{cfg}" / "results.json").exists()]
    a = blocks[0][1]
    for label in a:
        runs = []
        for rate in sorted({r["rate"] for _, res in blocks for r in res[label]["runs"]}):
            offset = 0
            for _, res in blocks:
                mine = [r for r in res[label]["runs"] if r["rate"] == rate]
                runs += [{**r, "repeat": r["repeat"] + offset} for r in mine]
                offset += len(mine)
        logs = []
        for blk, res in blocks:
            src = res[label].get("proxy_log")
            if src and Path(src).exists():
                t = out / "logs" / f"{blk}-{label.replace('[', '-').replace(']', '')}-proxy.log"
                shutil.copy(src, t); logs.append(str(t))
        doc[label] = {**a[label], "runs": runs, "proxy_log": logs[0] if logs else None,
                      "loadavg_before_up_blocks": [res[label].get("loadavg_before_up") for _, res in blocks],
                      "workload": {**a[label]["workload"], "seed": [res[label]["workload"]["seed"] for _, res in blocks]}}
write_json(doc, out / "results.json")
write_report(doc, out, title="disagg bench compare: " + ", ".join(doc))
print(list(doc))
