"""KV bytes per token and prefill FLOPs, checked against hand-computed values."""

from __future__ import annotations

import json
import struct

import pytest

from disagg.errors import ModelError
from disagg.kvmath import (
    BUILTIN_MODELS,
    arch_from_config,
    builtin_model,
    embedded_arch,
    kv_dtype_bytes,
    load_config_arch,
    resolve_model,
)
from disagg.modelgen import EMBEDDED_MODELS, build_model

KIB = 1024


def test_llama_8b_bf16_is_128_kib_per_token() -> None:
    m = BUILTIN_MODELS["llama-3.1-8b"]
    # 2 (K,V) x 32 layers x 8 KV heads x 128 head_dim x 2 bytes
    assert m.kv_bytes_per_token("bfloat16") == 2 * 32 * 8 * 128 * 2 == 131072
    assert m.kv_bytes_per_token("auto") == 131072
    assert m.kv_bytes_per_token("float16") == 131072
    assert m.kv_bytes_per_token("fp8") == 65536
    assert m.kv_bytes(2048) == 256 * KIB * KIB
    assert m.attention == "GQA"


def test_deepseek_v3_mla_is_latent_plus_rope() -> None:
    m = BUILTIN_MODELS["deepseek-v3"]
    assert m.attention == "MLA"
    assert m.kv_bytes_per_token("bf16") == 61 * (512 + 64) * 2 == 70272
    assert m.kv_bytes_per_token("fp8_e4m3") == 61 * (512 + 64)


@pytest.mark.parametrize(("name", "kib"), [
    ("llama-3.1-70b", 320), ("qwen2.5-7b", 56), ("qwen2.5-32b", 256), ("qwen3-8b", 144),
    ("qwen3-32b", 256), ("qwen3-30b-a3b", 96), ("mistral-7b", 128),
])
def test_reference_figures(name: str, kib: int) -> None:
    """Per-token KV sizes of popular models (bf16), as docs/the-one-question.md lists them."""
    assert BUILTIN_MODELS[name].kv_bytes_per_token() == kib * KIB


@pytest.mark.parametrize("name", sorted(EMBEDDED_MODELS))
def test_embedded_models_match_modelgen(name: str) -> None:
    assert embedded_arch(name).kv_bytes_per_token() == EMBEDDED_MODELS[name].kv_bytes_per_token


def test_tiny_is_1_kib_per_token() -> None:
    assert embedded_arch("tiny").kv_bytes_per_token() == 1024
    assert resolve_model("disagg:tiny").kv_bytes_per_token() == 1024


def test_config_written_by_make_model(tmp_path) -> None:
    """The config.json modelgen writes parses to 1 KiB/token and about the stored weight count."""
    out = build_model("tiny", tmp_path / "tiny")
    arch = load_config_arch(out)
    assert arch.kv_bytes_per_token() == 1024
    raw = (out / "model.safetensors").read_bytes()
    header = json.loads(raw[8:8 + struct.unpack("<Q", raw[:8])[0]])
    stored = 0
    for key, meta in header.items():
        if key != "__metadata__":
            count = 1
            for dim in meta["shape"]:
                count *= dim
            stored += count
    assert arch.params == pytest.approx(stored, rel=0.01)  # norms are not counted
    assert resolve_model("./x", local_path=out) == arch


def test_gemma3_sliding_layers_are_capped_at_the_window() -> None:
    m = BUILTIN_MODELS["gemma-3-27b"]
    per_layer = 2 * 16 * 128 * 2
    assert len(m.sliding_layers) == 52 and m.full_layers == 10
    assert m.kv_bytes(1000) == 62 * per_layer * 1000          # within the window: every layer
    assert m.kv_bytes(100_000) == per_layer * (10 * 100_000 + 52 * 1024)
    # past the window only the 10 full layers grow
    assert m.kv_bytes(20_000) - m.kv_bytes(10_000) == 10 * per_layer * 10_000


def test_gpt_oss_alternates_sliding_and_full() -> None:
    m = BUILTIN_MODELS["gpt-oss-120b"]
    assert m.sliding_layers == tuple(range(0, 36, 2)) and m.sliding_window == 128
    per_layer = 2 * 8 * 64 * 2
    assert m.kv_bytes(128) == 36 * per_layer * 128
    assert m.kv_bytes(8192) == per_layer * (18 * 8192 + 18 * 128)
    assert m.kv_bytes(8192) < m.kv_bytes_per_token() * 8192


def _cfg(**kw: object) -> dict[str, object]:
    base: dict[str, object] = {"num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2,
                               "hidden_size": 512, "intermediate_size": 1024, "vocab_size": 1000}
    base.update(kw)
    return base


@pytest.mark.parametrize(("extra", "sliding"), [
    ({"sliding_window": 64, "layer_types": ["sliding_attention", "full_attention"] * 2}, (0, 2)),
    ({"sliding_window": 64, "model_type": "gemma2"}, (0, 2)),
    ({"sliding_window": 64, "sliding_window_pattern": 2}, (0, 2)),
    ({"sliding_window": 64}, (0, 1, 2, 3)),                           # Mistral v0.1 style: every layer
    ({"sliding_window": 32768, "use_sliding_window": False}, ()),    # Qwen2: window off
    ({"sliding_window": None}, ()),
])
def test_config_sliding_window_layouts(extra: dict[str, object], sliding: tuple[int, ...]) -> None:
    arch = arch_from_config(_cfg(**extra), "m", "test")
    assert arch.sliding_layers == sliding
    per_layer = 2 * 2 * 64 * 2   # head_dim = 512 / 8
    assert arch.kv_bytes(1000) == per_layer * ((4 - len(sliding)) * 1000 + len(sliding) * (64 if sliding else 0))


def test_config_mla_and_moe() -> None:
    cfg = _cfg(kv_lora_rank=128, qk_rope_head_dim=32, qk_nope_head_dim=64, v_head_dim=64,
               n_routed_experts=16, num_experts_per_tok=2, moe_intermediate_size=256)
    arch = arch_from_config(cfg, "mini-mla", "test")
    assert arch.attention == "MLA"
    assert arch.kv_bytes_per_token() == 4 * (128 + 32) * 2
    assert arch.active_params < arch.params


def test_config_text_config_is_used() -> None:
    """Multimodal configs (Gemma 3) nest the language model under text_config."""
    arch = arch_from_config({"architectures": ["X"], "text_config": _cfg()}, "mm", "test")
    assert arch.layers == 4


def test_bad_config_names_the_file(tmp_path) -> None:
    (tmp_path / "config.json").write_text('{"hidden_size": 4}')
    with pytest.raises(ModelError, match=r"config.json.*num_hidden_layers"):
        load_config_arch(tmp_path)
    (tmp_path / "config.json").write_text("{nope")
    with pytest.raises(ModelError, match=r"config.json:1: invalid JSON"):
        load_config_arch(tmp_path)


@pytest.mark.parametrize(("hf_id", "name"), [
    ("meta-llama/Llama-3.1-8B-Instruct", "llama-3.1-8b"),
    ("meta-llama/Meta-Llama-3.1-70B-Instruct", "llama-3.1-70b"),
    ("Qwen/Qwen3-30B-A3B-Instruct-2507", "qwen3-30b-a3b"),
    ("Qwen/Qwen3-32B", "qwen3-32b"),
    ("google/gemma-3-27b-it", "gemma-3-27b"),
    ("deepseek-ai/DeepSeek-R1", "deepseek-v3"),
    ("openai/gpt-oss-20b", "gpt-oss-20b"),
    ("mistralai/Mistral-7B-Instruct-v0.3", "mistral-7b"),
])
def test_hf_ids_find_the_builtin_entry(hf_id: str, name: str) -> None:
    found = builtin_model(hf_id)
    assert found is not None and found.name == name


def test_unknown_model_lists_the_known_ones() -> None:
    with pytest.raises(ModelError, match=r"built-in table.*llama-3.1-8b"):
        resolve_model("acme/Nonexistent-13B")
    assert builtin_model("qwen3-8bx") is None  # a prefix must end at a dash


def test_unknown_kv_dtype() -> None:
    assert kv_dtype_bytes("FP8") == 1
    with pytest.raises(ModelError, match="int3"):
        kv_dtype_bytes("int3")


def test_prefill_flops_linear_term_and_attention() -> None:
    dense = BUILTIN_MODELS["llama-3.1-8b"]
    n = 1000
    attention = 4 * 32 * 128 * 32 * n * n / 2
    assert dense.prefill_flops(n) == pytest.approx(2 * 8.03e9 * n + attention)
    assert dense.prefill_flops(2 * n) > 2 * dense.prefill_flops(n)       # quadratic part
    moe = BUILTIN_MODELS["qwen3-30b-a3b"]
    assert moe.prefill_flops(n) < 2 * 4e9 * n + attention                 # active, not total, params


def test_a_model_in_the_local_hugging_face_cache_is_read_from_its_config(tmp_path, monkeypatch) -> None:
    """An id the built-in table lacks is found in the Hugging Face cache (its documented layout:
    models--ORG--NAME/refs/main names the snapshot), without any network."""
    repo = tmp_path / "hub" / "models--acme--Cached-3B"
    snapshot = repo / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc123")
    (snapshot / "config.json").write_text(json.dumps({
        "hidden_size": 2048, "intermediate_size": 8192, "vocab_size": 32000, "num_hidden_layers": 24,
        "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 128}))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    arch = resolve_model("acme/Cached-3B")
    assert arch.kv_bytes_per_token() == 2 * 24 * 4 * 128 * 2
    assert "abc123" in arch.source
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty"))
    with pytest.raises(ModelError, match="local Hugging Face cache"):
        resolve_model("acme/Cached-3B")
