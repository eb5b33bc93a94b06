"""Prompts of an exact token length for a model with a local tokenizer.json.

Used by the tests and the benchmarks: text from the shipped corpus, prefixed
with a tag so that distinct prompts never share a cached prefix.
"""

from __future__ import annotations

from functools import cache
from importlib import resources
from pathlib import Path

from tokenizers import Tokenizer


@cache
def _corpus() -> str:
    return resources.files("disagg").joinpath("data/corpus.txt").read_text(encoding="utf-8")


@cache
def load_tokenizer(model_dir: str | Path) -> Tokenizer:
    """The model's fast tokenizer (``tokenizer.json``)."""
    return Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))


def exact_prompt(tokenizer: Tokenizer, tokens: int, tag: str) -> str:
    """A prompt that the server counts as exactly ``tokens`` tokens (its BOS included).

    Starts with ``[tag]``; the rest is corpus text, repeated as needed.
    """
    text = f"[{tag}] " + _corpus() * (tokens // 400 + 2)
    ids = tokenizer.encode(text).ids[:tokens]
    return tokenizer.decode(ids[1:], skip_special_tokens=False)
