"""KV-cache arithmetic: how many bytes a prompt's KV cache takes, per model.

The KV cache of one token is, per attention layer:

* MHA / GQA / MQA: ``2 (K and V) x kv_heads x head_dim x bytes per element``
* MLA (DeepSeek-V2/V3): ``(kv_lora_rank + rope_dim) x bytes per element``
  (one compressed latent plus the decoupled RoPE key, no separate V)

Sliding-window layers keep only the last ``window`` tokens, so a prompt of
``n`` tokens stores ``min(n, window)`` tokens in those layers. Engines
allocate in blocks, so the real figure is rounded up to the block size; the
arithmetic here is the exact payload.

A :class:`ModelArch` comes from a model's ``config.json`` (a local directory),
from the embedded tiny models, or from :data:`BUILTIN_MODELS` (popular models,
for planning before any weights are downloaded). :func:`resolve_model` tries
them in that order.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from disagg.errors import ModelError

#: Bytes per element of each KV cache dtype (vLLM ``--kv-cache-dtype`` names
#: and torch names).
KV_DTYPE_BYTES: dict[str, int] = {
    "bfloat16": 2, "bf16": 2,
    "float16": 2, "fp16": 2, "half": 2,
    "float32": 4, "fp32": 4,
    "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1, "fp8_ds_mla": 1,
}


def kv_dtype_bytes(dtype: str) -> int:
    """Bytes per KV element for ``dtype`` (``auto`` means bf16, what these models ship)."""
    key = dtype.strip().lower()
    if key == "auto":
        key = "bfloat16"
    if key not in KV_DTYPE_BYTES:
        raise ModelError(f"unknown KV cache dtype {dtype!r}; expected one of auto, "
                         + ", ".join(KV_DTYPE_BYTES))
    return KV_DTYPE_BYTES[key]


@dataclass(frozen=True)
class ModelArch:
    """The shape of a model as far as KV size and prefill compute go."""

    name: str
    layers: int
    q_heads: int
    kv_heads: int                       # MLA: equals q_heads (unused for the KV size)
    head_dim: int
    params: float                       # total parameters
    active_params: float                # parameters used per token (MoE < total)
    kv_lora_rank: int = 0               # MLA latent width; 0 = not MLA
    rope_dim: int = 0                   # MLA decoupled RoPE key width
    sliding_window: int | None = None   # tokens kept by sliding-window layers
    sliding_layers: tuple[int, ...] = ()  # indices of the layers that use the window
    attn_width: int = 0                 # q_heads x mean(qk dim, v dim), for attention FLOPs
    source: str = "built-in table"      # where these figures come from
    params_estimated: bool = False      # True when counted from config shapes

    @property
    def attention(self) -> str:
        """``MLA``, ``MHA``, ``GQA`` or ``MQA``."""
        if self.kv_lora_rank:
            return "MLA"
        if self.kv_heads == self.q_heads:
            return "MHA"
        return "MQA" if self.kv_heads == 1 else "GQA"

    @property
    def full_layers(self) -> int:
        """Layers that keep the whole context."""
        return self.layers - len(self.sliding_layers)

    @property
    def width(self) -> int:
        """Attention width for the FLOP count (q_heads x head_dim unless given)."""
        return self.attn_width or self.q_heads * self.head_dim

    def layer_bytes_per_token(self, dtype: str = "auto") -> int:
        """KV bytes one layer stores for one token."""
        b = kv_dtype_bytes(dtype)
        if self.kv_lora_rank:
            return (self.kv_lora_rank + self.rope_dim) * b
        return 2 * self.kv_heads * self.head_dim * b

    def kv_bytes_per_token(self, dtype: str = "auto") -> int:
        """KV bytes per token over all layers, while the context fits every window.

        Beyond a sliding window the marginal cost drops to the full layers' share:
        use :meth:`kv_bytes` for a given prompt length.
        """
        return self.layers * self.layer_bytes_per_token(dtype)

    def kv_bytes(self, tokens: int, dtype: str = "auto") -> int:
        """KV bytes for a context of ``tokens`` tokens (sliding layers capped at the window)."""
        per_layer = self.layer_bytes_per_token(dtype)
        kept = tokens if self.sliding_window is None else min(tokens, self.sliding_window)
        return per_layer * (self.full_layers * tokens + len(self.sliding_layers) * kept)

    def prefill_flops(self, tokens: int) -> float:
        """FLOPs to prefill ``tokens`` tokens: 2 x active params x tokens + causal attention.

        Attention: 4 x width FLOPs per (query, key) pair (QK^T and AV); a full layer
        sees n^2/2 pairs, a sliding layer about n x min(n, window).
        """
        n = float(tokens)
        full_pairs = n * n / 2
        if self.sliding_window is None or n <= self.sliding_window:
            slide_pairs = full_pairs
        else:
            w = float(self.sliding_window)
            slide_pairs = n * w - w * w / 2
        pairs = self.full_layers * full_pairs + len(self.sliding_layers) * slide_pairs
        return 2.0 * self.active_params * n + 4.0 * self.width * pairs

    def describe(self) -> str:
        """One line: attention kind and the dimensions that set the KV size."""
        if self.kv_lora_rank:
            shape = f"MLA {self.layers} layers x (kv_lora_rank {self.kv_lora_rank} + rope {self.rope_dim})"
        else:
            shape = (f"{self.attention} {self.layers} layers x {self.kv_heads} KV heads "
                     f"x head_dim {self.head_dim}")
        if self.sliding_layers:
            shape += f"; {len(self.sliding_layers)} layers slide over {self.sliding_window} tokens"
        params = f"{human_count(self.params)} params"
        if self.active_params != self.params:
            params += f" ({human_count(self.active_params)} active)"
        if self.params_estimated:
            params += " (estimated from config)"
        return f"{shape}; {params}"


def human_count(n: float) -> str:
    """``8.03e9`` -> ``8.0B``, ``1.7e6`` -> ``1.7M``."""
    for scale, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= scale:
            return f"{n / scale:.1f}{suffix}"
    return f"{n:.0f}"


def alternating(layers: int, *, first_sliding: bool = True) -> tuple[int, ...]:
    """Indices of sliding layers when sliding and full layers alternate."""
    start = 0 if first_sliding else 1
    return tuple(range(start, layers, 2))


def every_nth_full(layers: int, n: int) -> tuple[int, ...]:
    """Indices of sliding layers when every ``n``-th layer is full (Gemma 3: n=6)."""
    return tuple(i for i in range(layers) if (i + 1) % n != 0)


def _gqa(name: str, layers: int, q: int, kv: int, hd: int, params: float,
         active: float | None = None, window: int | None = None,
         sliding: tuple[int, ...] = ()) -> ModelArch:
    return ModelArch(name=name, layers=layers, q_heads=q, kv_heads=kv, head_dim=hd, params=params,
                     active_params=active or params, sliding_window=window, sliding_layers=sliding)


#: Popular models from their published config.json (layers, heads, head_dim,
#: MLA ranks, sliding windows) and model cards (parameter counts).
BUILTIN_MODELS: dict[str, ModelArch] = {m.name: m for m in (
    _gqa("llama-3.1-8b", 32, 32, 8, 128, 8.03e9),
    _gqa("llama-3.1-70b", 80, 64, 8, 128, 70.6e9),
    _gqa("qwen2.5-7b", 28, 28, 4, 128, 7.62e9),
    _gqa("qwen2.5-32b", 64, 40, 8, 128, 32.5e9),
    _gqa("qwen3-8b", 36, 32, 8, 128, 8.2e9),
    _gqa("qwen3-32b", 64, 64, 8, 128, 32.8e9),
    _gqa("qwen3-30b-a3b", 48, 32, 4, 128, 30.5e9, active=3.3e9),
    _gqa("mistral-7b", 32, 32, 8, 128, 7.25e9),
    _gqa("gemma-2-9b", 42, 16, 8, 256, 9.24e9, window=4096, sliding=alternating(42)),
    _gqa("gemma-2-27b", 46, 32, 16, 128, 27.2e9, window=4096, sliding=alternating(46)),
    _gqa("gemma-3-12b", 48, 16, 8, 256, 12.2e9, window=1024, sliding=every_nth_full(48, 6)),
    _gqa("gemma-3-27b", 62, 32, 16, 128, 27.4e9, window=1024, sliding=every_nth_full(62, 6)),
    ModelArch(name="deepseek-v3", layers=61, q_heads=128, kv_heads=128, head_dim=128,
              params=671e9, active_params=37e9, kv_lora_rank=512, rope_dim=64,
              attn_width=128 * (192 + 128) // 2),
    _gqa("gpt-oss-20b", 24, 64, 8, 64, 20.9e9, active=3.6e9, window=128, sliding=alternating(24)),
    _gqa("gpt-oss-120b", 36, 64, 8, 64, 116.8e9, active=5.1e9, window=128, sliding=alternating(36)),
)}

#: Other names that map to a built-in entry (after normalisation).
BUILTIN_ALIASES: dict[str, str] = {
    "llama-3-8b": "llama-3.1-8b", "llama-3.2-8b": "llama-3.1-8b",
    "llama-3-70b": "llama-3.1-70b", "llama-3.3-70b": "llama-3.1-70b",
    "deepseek-r1": "deepseek-v3", "deepseek-v3.1": "deepseek-v3",
}


def normalise_model_name(name: str) -> str:
    """``meta-llama/Meta-Llama-3.1-8B-Instruct`` -> ``llama-3.1-8b-instruct``."""
    base = name.strip().rstrip("/").rsplit("/", 1)[-1].lower()
    base = re.sub(r"^meta-", "", base)
    return base.replace("_", "-")


def builtin_model(name: str) -> ModelArch | None:
    """The built-in entry whose name is the longest prefix of ``name``, else None."""
    norm = normalise_model_name(name)
    keys = list(BUILTIN_MODELS) + list(BUILTIN_ALIASES)
    best = max((k for k in keys if norm == k or norm.startswith(k + "-")), key=len, default=None)
    if best is None:
        return None
    return BUILTIN_MODELS[BUILTIN_ALIASES.get(best, best)]


def _get(cfg: Mapping[str, Any], key: str, default: Any = None) -> Any:
    value = cfg.get(key)
    return default if value is None else value


def _sliding(cfg: Mapping[str, Any], layers: int) -> tuple[int | None, tuple[int, ...]]:
    window = cfg.get("sliding_window")
    if not isinstance(window, int) or window <= 0 or cfg.get("use_sliding_window") is False:
        return None, ()
    types = cfg.get("layer_types")
    if isinstance(types, list) and types:
        return window, tuple(i for i, t in enumerate(types) if t == "sliding_attention")
    if str(cfg.get("model_type", "")).startswith("gemma2"):
        return window, alternating(layers)
    pattern = cfg.get("sliding_window_pattern")
    if isinstance(pattern, int) and pattern > 1:
        return window, every_nth_full(layers, pattern)
    return window, tuple(range(layers))


def _count_params(cfg: Mapping[str, Any], layers: int, q: int, kv: int, hd: int) -> tuple[float, float]:
    """(total, active) parameters estimated from the weight shapes a config implies."""
    h = int(cfg["hidden_size"])
    vocab = int(_get(cfg, "vocab_size", 0))
    if cfg.get("kv_lora_rank"):
        nope, rope = int(_get(cfg, "qk_nope_head_dim", hd)), int(_get(cfg, "qk_rope_head_dim", 0))
        v_dim, rank = int(_get(cfg, "v_head_dim", hd)), int(cfg["kv_lora_rank"])
        q_rank = int(_get(cfg, "q_lora_rank", 0))
        q_proj = h * q_rank + q_rank * q * (nope + rope) if q_rank else h * q * (nope + rope)
        attn = q_proj + h * (rank + rope) + rank * q * (nope + v_dim) + q * v_dim * h
    else:
        attn = h * q * hd + 2 * h * kv * hd + q * hd * h
    inter = int(_get(cfg, "intermediate_size", 4 * h))
    experts = int(_get(cfg, "n_routed_experts", _get(cfg, "num_experts", _get(cfg, "num_local_experts", 0))))
    dense_mlp = 3 * h * inter
    if experts:
        moe_inter = int(_get(cfg, "moe_intermediate_size", inter))
        top_k = int(_get(cfg, "num_experts_per_tok", 1))
        shared = int(_get(cfg, "n_shared_experts", 0)) * 3 * h * moe_inter
        dense_layers = int(_get(cfg, "first_k_dense_replace", 0))
        moe_layers = layers - dense_layers
        total_mlp = dense_layers * dense_mlp + moe_layers * (experts * 3 * h * moe_inter + shared + h * experts)
        active_mlp = dense_layers * dense_mlp + moe_layers * (top_k * 3 * h * moe_inter + shared + h * experts)
    else:
        total_mlp = active_mlp = layers * dense_mlp
    embed = vocab * h * (1 if cfg.get("tie_word_embeddings") else 2)
    return float(embed + layers * attn + total_mlp), float(embed + layers * attn + active_mlp)


def arch_from_config(config: Mapping[str, Any], name: str, source: str) -> ModelArch:
    """Build a :class:`ModelArch` from a Hugging Face ``config.json`` mapping."""
    cfg: Mapping[str, Any] = config.get("text_config") or config
    try:
        layers = int(cfg["num_hidden_layers"])
        q = int(cfg["num_attention_heads"])
        kv = int(_get(cfg, "num_key_value_heads", q))
        hd = int(_get(cfg, "head_dim", int(cfg["hidden_size"]) // q))
        total, active = _count_params(cfg, layers, q, kv, hd)
    except (KeyError, TypeError, ValueError, ZeroDivisionError) as exc:
        raise ModelError(f"{source}: cannot read the attention shape ({exc!r}); expected "
                         "num_hidden_layers, num_attention_heads, hidden_size") from exc
    window, sliding = _sliding(cfg, layers)
    rank = int(_get(cfg, "kv_lora_rank", 0))
    width = 0
    if rank:
        qk = int(_get(cfg, "qk_nope_head_dim", hd)) + int(_get(cfg, "qk_rope_head_dim", 0))
        width = q * (qk + int(_get(cfg, "v_head_dim", hd))) // 2
    return ModelArch(name=name, layers=layers, q_heads=q, kv_heads=kv, head_dim=hd, params=total,
                     active_params=active, kv_lora_rank=rank,
                     rope_dim=int(_get(cfg, "qk_rope_head_dim", 0)) if rank else 0,
                     sliding_window=window, sliding_layers=sliding, attn_width=width,
                     source=source, params_estimated=True)


def load_config_arch(path: str | Path) -> ModelArch:
    """Read ``config.json`` from a model directory (or the file itself)."""
    p = Path(path).expanduser()
    file = p / "config.json" if p.is_dir() else p
    try:
        config = json.loads(file.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ModelError(f"cannot read {file}: {exc.strerror or exc}") from exc
    except json.JSONDecodeError as exc:
        raise ModelError(f"{file}:{exc.lineno}: invalid JSON: {exc.msg}") from exc
    if not isinstance(config, dict):
        raise ModelError(f"{file}: expected a JSON object")
    name = file.parent.name if p.is_dir() or file.name == "config.json" else file.stem
    return arch_from_config(config, name, str(file))


def embedded_arch(name: str) -> ModelArch:
    """The arch of an embedded tiny model (``disagg make-model --embedded NAME``)."""
    from disagg.modelgen import EMBEDDED_MODELS  # numpy only, no torch

    if name not in EMBEDDED_MODELS:
        raise ModelError(f"unknown embedded model {name!r}; choose one of {', '.join(EMBEDDED_MODELS)}")
    c = EMBEDDED_MODELS[name]
    cfg = {"hidden_size": c.hidden, "intermediate_size": c.intermediate, "vocab_size": c.vocab_target,
           "num_hidden_layers": c.layers, "num_attention_heads": c.heads,
           "num_key_value_heads": c.kv_heads, "head_dim": c.head_dim}
    return arch_from_config(cfg, f"disagg:{name}", "embedded model")


def cached_config(model: str) -> Path | None:
    """``config.json`` of Hugging Face model ``model`` (``org/name``) in the local Hugging Face cache
    (``HF_HUB_CACHE``, else ``HF_HOME``/hub, else ~/.cache/huggingface/hub), or None; reads no network."""
    if model.count("/") != 1 or model.startswith(("/", ".", "~")):
        return None
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return None
    hf_home = os.environ.get("HF_HOME")
    cache = os.environ.get("HF_HUB_CACHE") or (str(Path(hf_home) / "hub") if hf_home else None)
    try:
        found = try_to_load_from_cache(model, "config.json", cache_dir=cache)
    except ValueError:   # not a valid repo id
        return None
    return Path(found) if isinstance(found, str) else None


def resolve_model(model: str, *, local_path: str | Path | None = None) -> ModelArch:
    """Find the arch for ``model``: embedded name, local config.json, the Hugging Face cache's
    config.json, or the built-in table.

    ``model`` is what a topology (or ``--model``) says: ``disagg:tiny``, a
    directory, or a Hugging Face id; ``local_path`` is the resolved directory
    to try first when it exists.
    """
    if model.startswith("disagg:"):
        return embedded_arch(model.split(":", 1)[1])
    for candidate in (local_path, model):
        if candidate is not None and (Path(candidate).expanduser() / "config.json").is_file():
            return load_config_arch(candidate)
    if model.endswith(".json") and Path(model).is_file():
        return load_config_arch(model)
    if (cached := cached_config(model)) is not None:
        return load_config_arch(cached)
    found = builtin_model(model)
    if found is None:
        raise ModelError(f"model {model!r}: no config.json there and not in the built-in table "
                         f"(known: {', '.join(BUILTIN_MODELS)}) nor in the local Hugging Face cache; point "
                         "--model at a directory holding the model's config.json")
    return found
