"""Train a small Llama here, offline, for what the embedded random-weight models cannot show.

The embedded models (``disagg/modelgen.py``) have random weights: their next-token distributions
are nearly flat, so a lossy KV wire format (fp8) flips greedy tokens on them for no reason a real
model would share, and their KV has none of a trained model's structure. This script trains a
small model of the same family on text that every machine has (this Python's own standard
library sources), so that ``benchmarks/fp8_accuracy.py`` can measure fp8's accuracy cost on a
model whose predictions mean something. It is still a small model (about 5 M parameters, 8
layers), not a production LLM: large models have KV outliers that a 5 M model need not have, so
``benchmarks/gpu/verify.sh`` (a real model on a GPU) remains the check that counts.

    python benchmarks/trained_model.py --out .disagg/models/stdlib-lm --minutes 12
    python benchmarks/trained_model.py --out DIR --minutes 2 --device cuda --corpus DIR2

The corpus: the standard library's ``*.py`` files (not its test suites), sorted by path; every
tenth file is held out (the accuracy benchmark draws its prompts from those). ``--corpus DIR`` reads (or, when
absent, writes) ``DIR/train.txt`` and ``DIR/held.txt``, so that another machine, with another
Python, can train on the same text. The model directory gets ``training.json`` beside the
weights: steps, tokens seen, the training loss at the end and the held-out loss.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sysconfig
import time
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from disagg.modelgen import TinyModelConfig, padded_vocab, train_tokenizer, write_tokenizer

#: the shape trained: 8 layers of 2 KV heads of 64 (4 KiB of bf16 KV per token), ~5 M parameters
SHAPE = TinyModelConfig(layers=8, hidden=256, heads=4, kv_heads=2, head_dim=64, intermediate=768,
                        vocab_target=2048, max_positions=4096)
#: the training window: prompts for the accuracy benchmark stay within it
SEQ = 512
HELD_OUT_EVERY = 10
#: folders of the standard library left out: its test suites and whatever is installed beside it
SKIPPED = {"test", "tests", "idle_test", "site-packages", "dist-packages"}


def corpus(cache: Path | None) -> tuple[str, str]:
    """(training text, held-out text): from ``cache`` when it holds them, else from this Python's
    standard library (written to ``cache`` when one is named)."""
    if cache is not None and (cache / "train.txt").is_file() and (cache / "held.txt").is_file():
        return (cache / "train.txt").read_text(encoding="utf-8"), (cache / "held.txt").read_text(encoding="utf-8")
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(f for f in stdlib.rglob("*.py") if not SKIPPED.intersection(f.relative_to(stdlib).parts))
    train = [f.read_text(encoding="utf-8", errors="replace") for i, f in enumerate(files) if i % HELD_OUT_EVERY]
    held = [f.read_text(encoding="utf-8", errors="replace") for i, f in enumerate(files) if not i % HELD_OUT_EVERY]
    texts = "\n".join(train), "\n".join(held)
    if cache is not None:
        cache.mkdir(parents=True, exist_ok=True)
        (cache / "train.txt").write_text(texts[0], encoding="utf-8")
        (cache / "held.txt").write_text(texts[1], encoding="utf-8")
    return texts


def llama_config(vocab: int, bos: int, eos: int) -> LlamaConfig:
    c = SHAPE
    return LlamaConfig(vocab_size=vocab, hidden_size=c.hidden, intermediate_size=c.intermediate,
                       num_hidden_layers=c.layers, num_attention_heads=c.heads, num_key_value_heads=c.kv_heads,
                       head_dim=c.head_dim, max_position_embeddings=c.max_positions, rms_norm_eps=1e-5,
                       rope_theta=10000.0, tie_word_embeddings=False, bos_token_id=bos, eos_token_id=eos)


def windows(ids: torch.Tensor, batch: int, rng: random.Random) -> torch.Tensor:
    starts = [rng.randrange(0, len(ids) - SEQ - 1) for _ in range(batch)]
    return torch.stack([ids[s:s + SEQ] for s in starts])


def mean_loss(model: LlamaForCausalLM, ids: torch.Tensor, device: str, count: int = 32) -> float:
    rng = random.Random(7)
    model.eval()
    with torch.no_grad(), torch.autocast(device_type=device.split(":")[0], dtype=torch.bfloat16):
        losses = [model(input_ids=(x := windows(ids, 1, rng).to(device)), labels=x).loss.item() for _ in range(count)]
    model.train()
    return sum(losses) / len(losses)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="the model directory to write")
    ap.add_argument("--minutes", type=float, default=12.0, help="training time (the learning rate decays over it)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--batch", type=int, default=0, help="windows per step (default: 8 on CPU, 64 on a GPU)")
    ap.add_argument("--corpus", type=Path, default=None, help="read/write train.txt and held.txt here")
    args = ap.parse_args()
    torch.manual_seed(0)
    rng = random.Random(0)
    train_text, held_text = corpus(args.corpus)
    tokenizer = train_tokenizer(SHAPE.vocab_target, train_text)
    vocab = padded_vocab(tokenizer)
    train_ids = torch.tensor(tokenizer.encode(train_text, add_special_tokens=False).ids)
    held_ids = torch.tensor(tokenizer.encode(held_text, add_special_tokens=False).ids)
    bos, eos = tokenizer.token_to_id("<s>"), tokenizer.token_to_id("</s>")
    model = LlamaForCausalLM(llama_config(vocab, bos, eos)).to(args.device)
    params = sum(p.numel() for p in model.parameters())
    batch = args.batch or (64 if args.device.startswith("cuda") else 8)
    print(f"corpus: {len(train_ids):,} training tokens, {len(held_ids):,} held out (vocab {vocab}); "
          f"model {params / 1e6:.1f} M parameters; {batch} x {SEQ} tokens per step on {args.device}", flush=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
    budget, warmup = args.minutes * 60, 30
    t0, step, loss = time.monotonic(), 0, float("nan")
    while (elapsed := time.monotonic() - t0) < budget:
        frac = elapsed / budget
        lr = 1e-3 * min(1.0, (step + 1) / warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))
        for group in opt.param_groups:
            group["lr"] = lr
        x = windows(train_ids, batch, rng).to(args.device)
        with torch.autocast(device_type=args.device.split(":")[0], dtype=torch.bfloat16):
            loss = model(input_ids=x, labels=x).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        if step % 50 == 0:
            print(f"step {step} ({elapsed:.0f} s): loss {loss.item():.3f}, lr {lr:.2e}", flush=True)
    held_loss = mean_loss(model, held_ids, args.device)
    args.out.mkdir(parents=True, exist_ok=True)
    model.to(torch.bfloat16).save_pretrained(args.out, safe_serialization=True)
    write_tokenizer(args.out, tokenizer, SHAPE.max_positions)
    summary = {"steps": step, "tokens_seen": step * batch * SEQ, "minutes": args.minutes, "device": args.device,
               "parameters": params, "train_loss": round(float(loss.item()), 4),
               "held_out_loss": round(held_loss, 4), "uniform_loss": round(math.log(vocab), 4), "seq": SEQ}
    (args.out / "training.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
