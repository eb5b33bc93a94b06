"""fp8 on the wire: what it costs in accuracy, measured on real engines with a trained model.

For each model and wire format asked for, this brings up a 1P1D on this machine (vLLM CPU
engines, the socket connector, every prompt split: ``local_1p1d``), sends each prompt through the
proxy (greedy, 32 tokens, ``logprobs: 1``), checks from the decode engine's counters that the
prompt's KV crossed the wire, and compares the answer with the prefill engine's own answer to the
same request: one engine alone, from KV it computed itself, which is the colocated reference (the
decode engine cannot give it: its prefix cache then holds the blocks as the wire brought them).

The prompts are windows of the corpus that ``benchmarks/trained_model.py`` trained on: half from
its held-out files (text the model never saw: uncertain predictions), half from its training
files (text it saw: confident predictions, the regime of a large model on ordinary text). Each
is 128-448 tokens, within the window the model was trained on.

    python benchmarks/trained_model.py --out .disagg/models/stdlib-lm --minutes 2 --device cuda  # once
    python benchmarks/fp8_accuracy.py --models .disagg/models/stdlib-lm,tiny --formats raw,fp8

(it takes the engine lock itself while its engines run; a few minutes).

Per row: completions whose 32 greedy tokens all equal the reference's, completions whose first
token does (that token comes from the transferred KV alone), the mean tokens in common before the
first difference, and the log-prob drift |lp - lp_ref| of the first token and of every token
before the first difference, in nats. ``raw`` is the control: it must match on every prompt.
``tiny`` (random weights) is there to show why a trained model is needed: its flat distributions
flip greedy tokens on the smallest perturbation. A last row per model sets the wire's fp8 beside
what vLLM users already accept: one engine with vLLM's own fp8 KV cache (``--kv-cache-dtype fp8``,
per-tensor scale 1.0 as on a model without calibrated scales) against the same references.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))           # benchmarks/: trained_model
sys.path.insert(0, str(Path(__file__).resolve().parent / "gpu"))   # verify_run's accuracy_summary
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))       # the repo root: harness
from tokenizers import Tokenizer
from verify_run import accuracy_summary

from disagg.modelgen import EMBEDDED_MODELS, train_tokenizer
from disagg.prometheus_text import sample_sum
from harness.engines import get_text, post_json
from harness.local_1p1d import Running1P1D, local_1p1d

MAX_TOKENS = 32
PROMPT_TOKENS = (128, 448)
EXTERNAL = ("vllm:prompt_tokens_by_source_total", {"source": "external_kv_transfer"})


def _external_tokens(engine: str) -> float:
    return sample_sum(get_text(engine + "/metrics"), EXTERNAL[0], **EXTERNAL[1])


def prompts(text: str, tokenizer: Tokenizer, count: int, seed: int) -> list[str]:
    """``count`` windows of ``text``, each starting at a line and 128-448 tokens long."""
    lines = text.splitlines(keepends=True)
    rng = random.Random(seed)
    out: list[str] = []
    while len(out) < count:
        start, target = rng.randrange(len(lines) - 400), rng.randint(*PROMPT_TOKENS)
        ids = tokenizer.encode("".join(lines[start:start + 400]), add_special_tokens=False).ids[:target - 1]
        if len(ids) == target - 1:
            out.append(tokenizer.decode(ids))
    return out


def corpus_prompts(model: str, per_kind: int) -> dict[str, list[str]]:
    """The prompts for ``model`` (a model directory, or an embedded model's name): held-out and seen
    windows of trained_model.py's corpus, in ``model``'s tokens."""
    from trained_model import corpus  # brings torch and transformers: imported only when needed

    train, held = corpus(None)
    if "/" in model:
        tokenizer = Tokenizer.from_file(str(Path(model) / "tokenizer.json"))
    else:                               # what build_model trains for it
        tokenizer = train_tokenizer(EMBEDDED_MODELS[model].vocab_target)
    return {"held-out": prompts(held, tokenizer, per_kind, 1), "seen": prompts(train, tokenizer, per_kind, 2)}


#: greedy completions' tokens and their log-probs, prompt by prompt
Answers = tuple[list[list[str]], list[list[float | None]]]


def add_answer(out: Answers, url: str, text: str, key: str | None = None) -> None:
    """Append to ``out`` the greedy completion of ``text`` from ``url`` (the proxy, or one engine
    with its ``key``)."""
    body = {"model": "m", "prompt": text, "max_tokens": MAX_TOKENS, "temperature": 0, "logprobs": 1,
            "ignore_eos": True}
    logprobs = post_json(url + "/v1/completions", body, key=key)["choices"][0]["logprobs"]
    out[0].append(logprobs["tokens"])
    out[1].append(logprobs["token_logprobs"])


def split_answers(run: Running1P1D, texts: list[str]) -> tuple[Answers, Answers, int]:
    """(the split answers through the proxy, the prefill engine's own answers, prompts whose KV did
    not cross the wire)."""
    prefill, decode = run.engine_urls["prefill[0]"], run.engine_urls["decode[0]"]
    got: Answers = ([], [])
    ref: Answers = ([], [])
    not_moved = 0
    for text in texts:
        before = _external_tokens(decode)
        add_answer(got, run.proxy_url, text)
        not_moved += _external_tokens(decode) - before <= 0
        add_answer(ref, prefill, text, run.engine_key)
    return got, ref, not_moved


def row(model: str, wire: str, kind: str, got: Answers, ref: Answers, not_moved: int | str) -> dict[str, Any]:
    s = accuracy_summary(ref[0], got[0], ref[1], got[1])
    print(f"| {Path(model).name} | {wire} | {kind} | {s['equal']}/{s['completions']} | "
          f"{s['first_token_equal']}/{s['completions']} | {s['mean_tokens_in_common']:.1f} | "
          f"{s['first_drift_mean']:.4f} / {s['first_drift_max']:.4f} | "
          f"{s['drift_mean']:.4f} / {s['drift_max']:.4f} | {not_moved} |", flush=True)
    return {"model": Path(model).name, "wire": wire, "prompts": kind, **s, "not_moved": not_moved}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=".disagg/models/stdlib-lm,tiny",
                    help="comma-separated: model directories (trained_model.py's) or embedded names")
    ap.add_argument("--formats", default="raw,fp8")
    ap.add_argument("--prompts", type=int, default=24, help="prompts per kind (held-out, seen)")
    ap.add_argument("--no-fp8-cache", dest="fp8_cache", action="store_false",
                    help="leave out the row of vLLM's own fp8 KV cache (one engine)")
    ap.add_argument("--json", type=Path, default=None, help="write the rows here too")
    args = ap.parse_args()
    rows = []
    print("| model | wire | prompts | greedy equal | first token equal | tokens in common (of 32) | "
          "first-token drift mean / max (nats) | drift of agreeing tokens mean / max | KV not moved |")
    print("|---|---|---|---:|---:|---:|---|---|---:|")
    for model in args.models.split(","):
        if "/" in model and not (Path(model) / "config.json").is_file():
            raise SystemExit(f"{model}: no model there; train one with benchmarks/trained_model.py --out {model}")
        model = str(Path(model).resolve()) if "/" in model else model
        kinds = corpus_prompts(model, args.prompts)
        refs: dict[str, Answers] = {}
        for fmt in args.formats.split(","):
            connector = f"{{type: socket, wire_format: {fmt}, streaming: false}}"
            with local_1p1d(f"fp8acc-{fmt}", connector=connector, model=model) as run:
                for kind, texts in kinds.items():
                    got, refs[kind], not_moved = split_answers(run, texts)
                    rows.append(row(model, fmt, kind, got, refs[kind], not_moved))
        if args.fp8_cache:
            # vLLM's own fp8 KV cache (per-tensor scale 1.0, as on a model without calibrated scales):
            # one engine alone answers, against the bf16-cache references of the runs above
            with local_1p1d("fp8acc-cache", connector="{type: socket, streaming: false}", model=model,
                            engine_args='["-O0", "--kv-cache-dtype", "fp8"]') as run:
                for kind, texts in kinds.items():
                    one: Answers = ([], [])
                    for text in texts:
                        add_answer(one, run.engine_urls["prefill[0]"], text, run.engine_key)
                    rows.append(row(model, "vLLM fp8 KV cache, one engine", kind, one, refs[kind], "-"))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
