"""The embedded tiny model: deterministic bytes, loadable shapes, sane tokenizer."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from disagg.errors import ModelError
from disagg.modelgen import EMBEDDED_MODELS, build_model, ensure_model


def _read_tree(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


def test_same_seed_same_bytes(tmp_path: Path) -> None:
    a = _read_tree(build_model("tiny", tmp_path / "a"))
    b = _read_tree(build_model("tiny", tmp_path / "b"))
    assert set(a) == {"config.json", "generation_config.json", "model.safetensors", "special_tokens_map.json",
                      "tokenizer.json", "tokenizer_config.json"}
    assert a == b


def test_safetensors_header_matches_config(tmp_path: Path) -> None:
    out = build_model("tiny", tmp_path / "m")
    cfg = json.loads((out / "config.json").read_text())
    raw = (out / "model.safetensors").read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + length])
    kv_rows = cfg["num_key_value_heads"] * cfg["head_dim"]
    assert header["model.layers.0.self_attn.k_proj.weight"]["shape"] == [kv_rows, cfg["hidden_size"]]
    assert header["model.embed_tokens.weight"]["shape"] == [cfg["vocab_size"], cfg["hidden_size"]]
    assert all(v["dtype"] == "BF16" for k, v in header.items() if k != "__metadata__")
    last = max(v["data_offsets"][1] for k, v in header.items() if k != "__metadata__")
    assert len(raw) == 8 + length + last


def test_kv_bytes_per_token() -> None:
    assert EMBEDDED_MODELS["tiny"].kv_bytes_per_token == 1024
    assert EMBEDDED_MODELS["tiny-kvheavy"].kv_bytes_per_token == 32 * 1024
    assert EMBEDDED_MODELS["tiny-kvdeep"].kv_bytes_per_token == 32 * 1024
    assert EMBEDDED_MODELS["tiny-kvdeep"].layers == 16


def test_tokenizer_round_trips_and_adds_bos(tmp_path: Path) -> None:
    from tokenizers import Tokenizer

    out = build_model("tiny", tmp_path / "m")
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    text = "Can this link carry the cache in less time than the prefill?"
    enc = tok.encode(text)
    assert enc.ids[0] == tok.token_to_id("<s>")
    assert tok.decode(enc.ids, skip_special_tokens=True) == text
    cfg = json.loads((out / "config.json").read_text())
    assert tok.get_vocab_size() <= cfg["vocab_size"]
    assert "chat_template" in json.loads((out / "tokenizer_config.json").read_text())


def test_ensure_model_reuses_existing(tmp_path: Path) -> None:
    out = ensure_model("tiny", tmp_path / "m")
    stamp = (out / "model.safetensors").stat().st_mtime_ns
    ensure_model("tiny", tmp_path / "m")
    assert (out / "model.safetensors").stat().st_mtime_ns == stamp


def test_unknown_model_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ModelError,
                       match="unknown embedded model 'huge'; choose one of tiny, tiny-kvheavy, tiny-kvdeep"):
        build_model("huge", tmp_path)


def test_ctrl_c_during_the_build_leaves_no_half_built_copy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from disagg import modelgen

    def interrupted(name: str, out_dir: str | Path) -> Path:
        build_model(name, out_dir)  # written, then Ctrl-C before the rename
        raise KeyboardInterrupt

    monkeypatch.setattr(modelgen, "build_model", interrupted)
    with pytest.raises(KeyboardInterrupt):
        ensure_model("tiny", tmp_path / "m")
    assert list(tmp_path.iterdir()) == []
