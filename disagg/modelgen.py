"""Build the embedded tiny models offline: random-weight Llama + byte-level BPE.

``build_model(name, out_dir)`` writes a Hugging Face model directory
(config.json, model.safetensors, tokenizer.json, tokenizer_config.json,
generation_config.json) that stock vLLM loads. Everything is derived from a
fixed seed and the corpus shipped in ``disagg/data/corpus.txt``, so the same
call writes the same bytes on every machine. Only numpy and tokenizers are
needed: no torch, no download.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from disagg.errors import ModelError

if TYPE_CHECKING:
    from tokenizers import Tokenizer

SPECIAL_TOKENS = ("<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>")
CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


@dataclass(frozen=True)
class TinyModelConfig:
    """Shape of one embedded model."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab_target: int = 1024
    max_positions: int = 8192
    seed: int = 1234
    # Random init scale: large enough that attention (and so the KV cache)
    # visibly changes the next token, small enough to stay numerically tame.
    init_std: float = 0.08

    @property
    def kv_bytes_per_token(self) -> int:
        """bf16 KV cache bytes per token: 2 (K and V) x layers x kv_heads x head_dim x 2."""
        return 2 * self.layers * self.kv_heads * self.head_dim * 2


EMBEDDED_MODELS: dict[str, TinyModelConfig] = {
    # 1 KiB of KV per token: the default for the demo and the tests.
    "tiny": TinyModelConfig(layers=2, hidden=256, heads=4, kv_heads=2, head_dim=64, intermediate=512),
    # 32 KiB of KV per token: for transfer benchmarks (tens of MB per request).
    "tiny-kvheavy": TinyModelConfig(layers=8, hidden=256, heads=8, kv_heads=8, head_dim=128,
                                    intermediate=512),
    # 32 KiB of KV per token over 16 layers (2 KiB each): a handoff that streams layer by layer
    # has 16 steps to overlap with the prefill.
    "tiny-kvdeep": TinyModelConfig(layers=16, hidden=256, heads=8, kv_heads=4, head_dim=128,
                                   intermediate=512),
}


def train_tokenizer(vocab_target: int, corpus: str | None = None) -> Tokenizer:
    """A byte-level BPE with the embedded models' special tokens, trained on ``corpus`` (default: the
    corpus shipped in ``disagg/data/corpus.txt``). Called by :func:`build_model`, and by
    ``benchmarks/trained_model.py`` for a model trained on a larger text."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    if corpus is None:
        corpus = resources.files("disagg").joinpath("data/corpus.txt").read_text(encoding="utf-8")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_target, min_frequency=2,
                                  special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tokenizer.train_from_iterator(corpus.splitlines(keepends=True), trainer=trainer)
    bos = tokenizer.token_to_id("<s>")
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)])
    return tokenizer


def _bf16_bytes(array: np.ndarray) -> bytes:
    """float32 -> bfloat16 (round to nearest even), little-endian bytes."""
    bits = np.ascontiguousarray(array, dtype=np.float32).view(np.uint32)
    rounded = (bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
    return rounded.astype("<u2").tobytes()


def _write_safetensors(path: Path, tensors: dict[str, np.ndarray]) -> None:
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    blobs = []
    offset = 0
    for name in sorted(tensors):
        blob = _bf16_bytes(tensors[name])
        header[name] = {"dtype": "BF16", "shape": list(tensors[name].shape),
                        "data_offsets": [offset, offset + len(blob)]}
        blobs.append(blob)
        offset += len(blob)
    head = json.dumps(header, separators=(",", ":"), sort_keys=True).encode()
    head += b" " * (-len(head) % 8)
    with open(path, "wb") as fh:
        fh.write(struct.pack("<Q", len(head)))
        fh.write(head)
        for blob in blobs:
            fh.write(blob)


def _weights(cfg: TinyModelConfig, vocab: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(cfg.seed)

    def normal(*shape: int) -> np.ndarray:
        return rng.normal(0.0, cfg.init_std, size=shape).astype(np.float32)

    t: dict[str, np.ndarray] = {"model.embed_tokens.weight": rng.normal(0.0, 1.0, size=(vocab, cfg.hidden))
                                .astype(np.float32)}
    for i in range(cfg.layers):
        p = f"model.layers.{i}."
        t[p + "self_attn.q_proj.weight"] = normal(cfg.heads * cfg.head_dim, cfg.hidden)
        t[p + "self_attn.k_proj.weight"] = normal(cfg.kv_heads * cfg.head_dim, cfg.hidden)
        t[p + "self_attn.v_proj.weight"] = normal(cfg.kv_heads * cfg.head_dim, cfg.hidden)
        t[p + "self_attn.o_proj.weight"] = normal(cfg.hidden, cfg.heads * cfg.head_dim)
        t[p + "mlp.gate_proj.weight"] = normal(cfg.intermediate, cfg.hidden)
        t[p + "mlp.up_proj.weight"] = normal(cfg.intermediate, cfg.hidden)
        t[p + "mlp.down_proj.weight"] = normal(cfg.hidden, cfg.intermediate)
        t[p + "input_layernorm.weight"] = np.ones(cfg.hidden, dtype=np.float32)
        t[p + "post_attention_layernorm.weight"] = np.ones(cfg.hidden, dtype=np.float32)
    t["model.norm.weight"] = np.ones(cfg.hidden, dtype=np.float32)
    t["lm_head.weight"] = normal(vocab, cfg.hidden)
    return t


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def padded_vocab(tokenizer: Tokenizer) -> int:
    """The embedding's rows for ``tokenizer``: its vocabulary padded to a multiple of 64."""
    return -(-tokenizer.get_vocab_size() // 64) * 64


def write_tokenizer(out: Path, tokenizer: Tokenizer, max_positions: int) -> tuple[int, int]:
    """Write the tokenizer files of a model directory (fast tokenizer, chat template, special
    tokens); return the (bos, eos) token ids for its config."""
    (out / "tokenizer.json").write_text(tokenizer.to_str(), encoding="utf-8")
    _write_json(out / "tokenizer_config.json", {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>", "eos_token": "</s>", "pad_token": "</s>",
        "model_max_length": max_positions,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
    })
    _write_json(out / "special_tokens_map.json", {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "</s>"})
    bos, eos = tokenizer.token_to_id("<s>"), tokenizer.token_to_id("</s>")
    if bos is None or eos is None:
        raise ModelError("the tokenizer has no <s> or </s> token")
    return bos, eos


def build_model(name: str, out_dir: str | Path) -> Path:
    """Write embedded model ``name`` to ``out_dir`` (created); return the directory.

    Deterministic: the same name gives byte-identical files.
    """
    if name not in EMBEDDED_MODELS:
        raise ModelError(f"unknown embedded model {name!r}; choose one of {', '.join(EMBEDDED_MODELS)}")
    cfg = EMBEDDED_MODELS[name]
    out = Path(out_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ModelError(f"cannot create model directory {out}: {exc.strerror or exc}") from exc

    tokenizer = train_tokenizer(cfg.vocab_target)
    vocab = padded_vocab(tokenizer)
    bos, eos = write_tokenizer(out, tokenizer, cfg.max_positions)
    _write_json(out / "config.json", {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": cfg.hidden, "intermediate_size": cfg.intermediate,
        "num_hidden_layers": cfg.layers, "num_attention_heads": cfg.heads,
        "num_key_value_heads": cfg.kv_heads, "head_dim": cfg.head_dim,
        "vocab_size": vocab, "max_position_embeddings": cfg.max_positions,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "hidden_act": "silu",
        "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False,
        "torch_dtype": "bfloat16", "bos_token_id": bos, "eos_token_id": eos,
    })
    _write_json(out / "generation_config.json", {"bos_token_id": bos, "eos_token_id": eos})
    _write_safetensors(out / "model.safetensors", _weights(cfg, vocab))
    return out


def ensure_model(name: str, out_dir: str | Path) -> Path:
    """Build the embedded model unless a complete copy is already there."""
    out = Path(out_dir)
    if (out / "model.safetensors").is_file() and (out / "config.json").is_file():
        return out
    staging = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    try:
        build_model(name, staging)
        staging.rename(out)  # atomic: a concurrent builder may have won, which is fine
    except OSError:
        if not (out / "model.safetensors").is_file():
            raise
    finally:  # also on Ctrl-C during the build: no half-built copy is left behind
        shutil.rmtree(staging, ignore_errors=True)
    return out
