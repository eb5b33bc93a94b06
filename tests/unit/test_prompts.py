"""Exact-length prompts for the embedded model."""

from __future__ import annotations

import pytest

from disagg.modelgen import build_model
from disagg.prompts import exact_prompt, load_tokenizer


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    return load_tokenizer(build_model("tiny", tmp_path_factory.mktemp("m") / "tiny"))


@pytest.mark.parametrize("tokens", [8, 50, 512, 1500, 4000])
def test_prompt_has_exact_length(tokenizer, tokens: int) -> None:  # type: ignore[no-untyped-def]
    prompt = exact_prompt(tokenizer, tokens, "t")
    assert len(tokenizer.encode(prompt).ids) == tokens


def test_tags_make_prompts_distinct(tokenizer) -> None:  # type: ignore[no-untyped-def]
    a, b = exact_prompt(tokenizer, 100, "a"), exact_prompt(tokenizer, 100, "b")
    assert a != b and a.startswith("[a]") and b.startswith("[b]")
