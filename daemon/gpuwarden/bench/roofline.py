"""The single-stream decode ceiling: memory bandwidth / bytes read per generated token.

Each token reads every weight once (its share on each tensor-parallel GPU) and the KV cache of the context so
far. Weight bytes come from the safetensors headers, as stored (a quantized checkpoint counts its packed
bytes); the KV cache's size per token from config.json. Whatever cannot be read is said, not guessed.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..serving.lint.model import ModelUnreadable, entries_of, headers, read_json, roots_of

KV_BYTES = {"fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1, "fp8_ds_mla": 1, "bfloat16": 2, "float16": 2, "half": 2,
            "bf16": 2, "fp16": 2, "float32": 4, "float": 4}
MAX_COUNT = 2**31  # a layer, head or width count past this is no model's


@dataclass(frozen=True)
class ModelBytes:
    weights: int  # bytes of every tensor, as stored
    files: int
    kv_per_token: int | None  # bytes of K and V per token over all layers; None: config.json lacks what it needs
    kv_note: str


def tensor_bytes(header: dict, name: str) -> int:
    """The tensor bytes one .safetensors file holds, from its header alone (each tensor's data_offsets)."""
    total = 0
    for tensor, entry in header.items():
        if tensor == "__metadata__":
            continue
        offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(_offset(o) for o in offsets)
                and offsets[0] <= offsets[1]):
            raise ModelUnreadable(f"{name}: tensor {tensor[:80]!r} has no data_offsets [start, end]")
        total += offsets[1] - offsets[0]
    return total


def model_bytes(model_dir: Path, kv_cache_dtype: str | None = None) -> ModelBytes:
    """Weights and KV bytes per token of a local model directory, read as the lint reads one (serving/lint/model.py:
    every file a regular one inside the model, each size capped); ModelUnreadable says why not."""
    if not model_dir.is_dir():
        raise ModelUnreadable(f"{model_dir} is not a directory this user can read")
    roots = roots_of(model_dir)
    shards = sorted(n for n in entries_of(model_dir) if n.endswith(".safetensors"))
    if not shards:
        raise ModelUnreadable(f"{model_dir} holds no *.safetensors files")
    weights = sum(tensor_bytes(header, name) for name, header in headers(model_dir, shards, roots))
    kv, note = kv_bytes_per_token(model_dir / "config.json", kv_cache_dtype)
    return ModelBytes(weights, len(shards), kv, note)


def kv_bytes_per_token(config_file: Path, kv_cache_dtype: str | None) -> tuple[int | None, str]:
    """2 (K and V) x layers x KV heads x head size x bytes per element; (None, why) when config.json lacks it."""
    try:
        config = read_json(config_file, roots_of(config_file.parent))
    except ModelUnreadable as exc:
        return None, f"no KV size: {exc}"
    if not isinstance(config, dict):
        return None, f"no KV size: {config_file} is not a JSON object"
    text = config.get("text_config")
    config = text if isinstance(text, dict) else config  # multimodal configs nest the language model's
    layers, heads, hidden = (_count(config.get(k)) for k in ("num_hidden_layers", "num_attention_heads",
                                                              "hidden_size"))
    kv_heads = _count(config.get("num_key_value_heads", heads))
    head_dim = _count(config.get("head_dim")) or (hidden // heads if heads and hidden else None)
    if not (layers and kv_heads and head_dim):
        return None, f"no KV size: {config_file} lacks num_hidden_layers, num_key_value_heads or head_dim"
    dtype = kv_cache_dtype if kv_cache_dtype not in (None, "auto") else str(config.get("torch_dtype", "bfloat16"))
    per = KV_BYTES.get(dtype.removeprefix("torch."))
    if per is None:
        return None, f"no KV size: unknown KV cache dtype {dtype[:40]}"
    return 2 * layers * kv_heads * head_dim * per, f"{layers} layers x {kv_heads} KV heads x {head_dim} x {per} B x 2"


def _offset(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**63


def _count(value) -> int | None:
    """A positive whole number config.json can mean (not a bool, not 10**400)."""
    return value if isinstance(value, int) and not isinstance(value, bool) and 0 < value < MAX_COUNT else None


def ceiling_tokens_per_s(bandwidth_bytes_per_s: float, weight_bytes: float, tp: int = 1,
                         kv_bytes_per_token: float = 0.0, context_tokens: float = 0.0) -> float:
    """Decode tok/s one stream cannot beat: bandwidth (summed over the tp GPUs) / bytes read per token.
    Each GPU reads its 1/tp of the weights and of the KV cache, at its 1/tp of the bandwidth."""
    per_gpu_bytes = (weight_bytes + kv_bytes_per_token * context_tokens) / tp
    return (bandwidth_bytes_per_s / tp) / per_gpu_bytes
