"""The worked tables of docs/the-one-question.md: popular models x link classes.

Prints Markdown. Every figure comes from disagg.planning (the same arithmetic
as ``disagg plan``): KV sizes from the built-in model table, link rates from
the nominal link table, prefill times ESTIMATED from each device's spec sheet.

    python benchmarks/one_question_table.py [--prompt-tokens 2048] [--devices h100,gb10,rtx-4090]
"""

from __future__ import annotations

import argparse

from disagg.hardware import DEVICES, PREFILL_UTILISATION
from disagg.kvmath import BUILTIN_MODELS
from disagg.planning import (
    LINK_CLASSES,
    NO_PAY,
    PAYS,
    MemoryEstimate,
    device_prefill,
    link_class_estimate,
    make_plan,
)
from disagg.units import fmt_bytes, fmt_seconds

SHORT = {PAYS: "pays", NO_PAY: "no"}
#: loopback TCP is for CPU-only demos on one box, not a link between GPU hosts
LINKS = [name for name in LINK_CLASSES if name != "loopback"]


def _ratio(r: float) -> str:
    return f"{r:.0f}" if r >= 10 else f"{r:.2f}"


def size_table(prompts: list[int]) -> list[str]:
    """KV bytes per token and per prompt, per model."""
    head = ["model", "attention", "KV/token (bf16)"] + [f"{n:,}-token prompt" for n in prompts]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for m in BUILTIN_MODELS.values():
        cells = [m.name, m.attention + (f" + {len(m.sliding_layers)} sliding" if m.sliding_layers else ""),
                 fmt_bytes(m.kv_bytes_per_token())] + [fmt_bytes(m.kv_bytes(n)) for n in prompts]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def handoff_table(prompt: int) -> list[str]:
    """Handoff time of one prompt's KV, per model and link class."""
    links = {name: link_class_estimate(name) for name in LINKS}
    head = ["model"] + [LINK_CLASSES[n].label.replace(", TCP", "") for n in links]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for m in BUILTIN_MODELS.values():
        cells = [m.name] + [fmt_seconds(est.handoff_s(m.kv_bytes(prompt))) for est in links.values()]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def verdict_table(prompt: int, device: str) -> list[str]:
    """Verdict (and handoff/prefill ratio) per model and link class, prefill on ``device``."""
    spec = DEVICES[device]
    head = ["model", f"prefill (est.) on {spec.label}"] + [LINK_CLASSES[n].label.replace(", TCP", "")
                                                            for n in LINKS]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for m in BUILTIN_MODELS.values():
        prefill = device_prefill(spec, m)
        cells = [m.name, fmt_seconds(prefill.seconds(prompt))]
        for name in LINKS:
            plan = make_plan(m, "bfloat16", link_class_estimate(name), prefill, MemoryEstimate(None, ""),
                             [prompt], 0)
            c = plan.classes[0]
            cells.append(f"{SHORT.get(c.verdict, c.verdict)} ({_ratio(c.ratio)})")
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def main() -> None:
    """Print all tables."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--prompt-tokens", type=int, default=2048)
    p.add_argument("--devices", default="h100,gb10,rtx-4090")
    args = p.parse_args()
    n = args.prompt_tokens
    out = ["### KV cache size (bf16)", "", *size_table([n, 4 * n, 16 * n]), "",
           f"### Handoff time for one {n:,}-token prompt", "", *handoff_table(n), ""]
    for device in args.devices.split(","):
        out += [f"### Verdict for {n:,}-token prompts, prefill on {DEVICES[device].label} "
                f"(estimate: {PREFILL_UTILISATION:.0%} of {DEVICES[device].bf16_tflops:g} TFLOP/s)", "",
                *verdict_table(n, device), ""]
    print("\n".join(out).rstrip())


if __name__ == "__main__":
    main()
