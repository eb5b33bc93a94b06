"""The NIXL part of the loopback sitting (N-replicas, N-auto, N-split; block A's workload) in one report in /tmp/sL/nixl."""
import shutil
from pathlib import Path
from disagg.bench.report import load_json, write_json, write_report
root = Path("/tmp/sL"); out = root / "nixl"; (out / "logs").mkdir(parents=True, exist_ok=True)
doc = {}
for cfg in ("replicas", "auto", "split"):
    part = load_json(root / f"N-{cfg}" / "results.json")
    for label, res in part.items():
        src = res.get("proxy_log")
        if src and Path(src).exists():
            t = out / "logs" / f"N-{label.replace('[', '-').replace(']', '')}-proxy.log"
            shutil.copy(src, t); res = {**res, "proxy_log": str(t)}
        doc[label] = res
write_json(doc, out / "results.json")
write_report(doc, out, title="disagg bench compare: " + ", ".join(doc))
print(list(doc))
