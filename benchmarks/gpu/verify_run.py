"""Helper of benchmarks/gpu/verify.sh: greedy outputs through a proxy, and
"did KV move" from the engines' Prometheus metrics.

    python verify_run.py generate URL MODEL OUT.json       # greedy completions of PROMPTS
    python verify_run.py compare REF.json GOT.json          # exit 1 unless equal
    python verify_run.py accuracy REF.json GOT.json         # what a lossy wire format costs (report)
    python verify_run.py kv-moved ENGINE PREFILL_URL DECODE_URL   # exit 1 unless KV moved

``generate`` writes ``{"texts": [...], "tokens": [[...]], "logprobs": [[...]]}`` (the greedy
tokens and their log-probs, ``logprobs: 1``); ``compare`` and ``accuracy`` read that, or an older
plain list of texts (``compare`` only).

Standard library only, so it runs in any of the script's venvs.
"""

from __future__ import annotations

import json
import re
import sys
import urllib.request

#: long enough to span several KV blocks / LMCache chunks (256 tokens)
PROMPTS = [
    "Explain, step by step, how a bicycle gear system trades force for speed. " * 12,
    "List the planets of the solar system and one fact about each. " * 10,
    "Write a short story about a lighthouse keeper who finds a message in a bottle. " * 8,
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n" * 15,
]
MAX_TOKENS = 32


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as resp:
        return json.loads(resp.read())


def _metrics(url: str) -> dict[str, float]:
    """Sum of every sample per metric name (labels folded)."""
    with urllib.request.urlopen(url.rstrip("/") + "/metrics", timeout=30) as resp:
        text = resp.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = re.match(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{[^}]*\})?\s+([-+0-9.eEinfNa]+)$", line)
        if m:
            out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(2))
    return out


def generate(url: str, model: str, out: str) -> int:
    texts, tokens, logprobs = [], [], []
    for prompt in PROMPTS:
        reply = _post(url.rstrip("/") + "/v1/completions",
                      {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "logprobs": 1})
        choice = reply["choices"][0]
        texts.append(choice["text"])
        tokens.append(choice["logprobs"]["tokens"])
        logprobs.append(choice["logprobs"]["token_logprobs"])
    with open(out, "w") as fh:
        json.dump({"texts": texts, "tokens": tokens, "logprobs": logprobs}, fh, indent=1)
    print(f"generated {len(texts)} completions -> {out}")
    return 0


def _load(path: str) -> dict:
    with open(path) as fh:
        data = json.load(fh)
    return data if isinstance(data, dict) else {"texts": data}


def compare(ref: str, got: str) -> int:
    a, b = _load(ref)["texts"], _load(got)["texts"]
    bad = [i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y]
    for i in bad:
        print(f"prompt {i}: colocated {a[i]!r}\n          disaggregated {b[i]!r}")
    print("greedy outputs equal" if not bad else f"{len(bad)} of {len(a)} outputs differ")
    return 1 if bad else 0


def accuracy_summary(ref_tokens: list[list[str]], got_tokens: list[list[str]],
                     ref_logprobs: list[list[float | None]], got_logprobs: list[list[float | None]]) -> dict:
    """What a lossy run changed against a reference, completion by completion: how many greedy
    completions are equal, how many share their first token, the tokens in common before the first
    difference, and the log-prob drift of the tokens both chose while they agree (after a difference
    the contexts differ). Called by :func:`accuracy` and by ``benchmarks/fp8_accuracy.py``."""
    same = first = 0
    common: list[int] = []
    drifts: list[float] = []
    first_drifts: list[float] = []
    for ta, tb, la, lb in zip(ref_tokens, got_tokens, ref_logprobs, got_logprobs, strict=True):
        k = next((i for i, (x, y) in enumerate(zip(ta, tb, strict=False)) if x != y), min(len(ta), len(tb)))
        same += ta == tb
        first += k > 0
        common.append(k)
        pairs = [abs(x - y) for x, y in zip(la[:k], lb[:k], strict=True) if x is not None and y is not None]
        drifts += pairs
        if k and la[0] is not None and lb[0] is not None:
            first_drifts.append(abs(la[0] - lb[0]))
    return {"completions": len(common), "equal": same, "first_token_equal": first,
            "mean_tokens_in_common": sum(common) / len(common) if common else 0.0,
            "drift_mean": sum(drifts) / len(drifts) if drifts else 0.0, "drift_max": max(drifts, default=0.0),
            "drift_tokens": len(drifts),
            "first_drift_mean": sum(first_drifts) / len(first_drifts) if first_drifts else 0.0,
            "first_drift_max": max(first_drifts, default=0.0)}


def accuracy(ref: str, got: str) -> int:
    """Greedy-match rate, tokens in common before the first difference, and the log-prob drift of
    the tokens both runs chose (while they agree). A report: exit 0, unless the files are not
    comparable."""
    a, b = _load(ref), _load(got)
    if "tokens" not in a or "tokens" not in b:
        print("accuracy needs files written by this version of `generate` (tokens and log-probs)")
        return 2
    s = accuracy_summary(a["tokens"], b["tokens"], a["logprobs"], b["logprobs"])
    print(f"greedy match {s['equal']}/{s['completions']}; tokens in common before the first difference: "
          f"mean {s['mean_tokens_in_common']:.1f} of {MAX_TOKENS}; log-prob drift of agreeing tokens: mean "
          f"{s['drift_mean']:.4f}, max {s['drift_max']:.4f} nats over {s['drift_tokens']} tokens")
    return 0


def kv_moved(engine: str, prefill: str, decode: str) -> int:
    p, d = _metrics(prefill), _metrics(decode)
    if engine == "sglang":
        # decode-mode SGLang cannot prefill by itself: answers mean KV arrived;
        # the prefill side also reports what it sent
        failed = p.get("sglang:num_transfer_failed_reqs_total", 0) + d.get("sglang:num_transfer_failed_reqs_total", 0)
        prompt = p.get("sglang:prompt_tokens_total", 0)
        sent_mb = p.get("sglang:kv_transfer_total_mb", 0)
        print(f"sglang prefill prompt tokens {prompt:.0f}, kv_transfer_total_mb {sent_mb:.3f}, failed {failed:.0f}")
        return 0 if prompt > 0 and failed == 0 else 1
    hits = d.get("vllm:external_prefix_cache_hits_total", 0)
    queries = d.get("vllm:external_prefix_cache_queries_total", 0)
    print(f"vllm decode external (connector) prefix-cache hits {hits:.0f} of {queries:.0f} queried tokens")
    return 0 if hits > 0 else 1


def main(argv: list[str]) -> int:
    cmd, args = argv[0], argv[1:]
    return {"generate": generate, "compare": compare, "accuracy": accuracy, "kv-moved": kv_moved}[cmd](*args)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
