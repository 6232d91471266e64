"""The single-stream decode ceiling: memory bandwidth / bytes read per generated token.

Each token reads every weight once (its share on each tensor-parallel GPU) and the KV cache of the context so
far. Weight bytes come from the safetensors headers, as stored (a quantized checkpoint counts its packed
bytes); the KV cache's size per token from config.json. Whatever cannot be read is said, not guessed.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

MAX_HEADER_BYTES = 100 * 2**20  # safetensors caps its header at 100 MB
KV_BYTES = {"fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1, "fp8_ds_mla": 1, "bfloat16": 2, "float16": 2, "half": 2,
            "bf16": 2, "fp16": 2, "float32": 4, "float": 4}


class ModelUnreadable(Exception):
    """One line for the report: why the weights or the KV size cannot be known."""


@dataclass(frozen=True)
class ModelBytes:
    weights: int  # bytes of every tensor, as stored
    files: int
    kv_per_token: int | None  # bytes of K and V per token over all layers; None: config.json lacks what it needs
    kv_note: str


def safetensors_bytes(path: Path) -> int:
    """The tensor bytes one .safetensors file holds, from its header alone (8-byte length, then JSON)."""
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise ModelUnreadable(f"{path}: too short for a safetensors file")
        (size,) = struct.unpack("<Q", raw)
        if size > MAX_HEADER_BYTES:
            raise ModelUnreadable(f"{path}: header of {size} bytes is not a safetensors header")
        try:
            header = json.loads(f.read(size))
        except ValueError:
            raise ModelUnreadable(f"{path}: the header is not JSON") from None
    total = 0
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        start, end = entry["data_offsets"]
        total += end - start
    return total


def model_bytes(model_dir: Path, kv_cache_dtype: str | None = None) -> ModelBytes:
    """Weights and KV bytes per token of a local model directory; ModelUnreadable says why not."""
    try:
        files = sorted(model_dir.glob("*.safetensors"))
        if not model_dir.is_dir():
            raise ModelUnreadable(f"{model_dir} is not a directory this user can read")
    except OSError as exc:
        raise ModelUnreadable(f"{model_dir}: {exc.strerror}") from None
    if not files:
        raise ModelUnreadable(f"{model_dir} holds no *.safetensors files")
    try:
        weights = sum(safetensors_bytes(f) for f in files)
    except OSError as exc:
        raise ModelUnreadable(f"{exc.filename}: {exc.strerror}") from None
    kv, note = kv_bytes_per_token(model_dir / "config.json", kv_cache_dtype)
    return ModelBytes(weights, len(files), kv, note)


def kv_bytes_per_token(config_file: Path, kv_cache_dtype: str | None) -> tuple[int | None, str]:
    """2 (K and V) x layers x KV heads x head size x bytes per element; (None, why) when config.json lacks it."""
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError) as exc:
        return None, f"no KV size: {config_file}: {getattr(exc, 'strerror', None) or exc}"
    config = config.get("text_config", config)  # multimodal configs nest the language model's
    layers = config.get("num_hidden_layers")
    heads = config.get("num_attention_heads")
    kv_heads = config.get("num_key_value_heads", heads)
    head_dim = config.get("head_dim") or (config["hidden_size"] // heads if heads and config.get("hidden_size")
                                           else None)
    if not (layers and kv_heads and head_dim):
        return None, f"no KV size: {config_file} lacks num_hidden_layers, num_key_value_heads or head_dim"
    dtype = kv_cache_dtype if kv_cache_dtype not in (None, "auto") else str(config.get("torch_dtype", "bfloat16"))
    per = KV_BYTES.get(dtype.removeprefix("torch."))
    if per is None:
        return None, f"no KV size: unknown KV cache dtype {dtype}"
    return 2 * layers * kv_heads * head_dim * per, f"{layers} layers x {kv_heads} KV heads x {head_dim} x {per} B x 2"


def ceiling_tokens_per_s(bandwidth_bytes_per_s: float, weight_bytes: float, tp: int = 1,
                         kv_bytes_per_token: float = 0.0, context_tokens: float = 0.0) -> float:
    """Decode tok/s one stream cannot beat: bandwidth (summed over the tp GPUs) / bytes read per token.
    Each GPU reads its 1/tp of the weights and of the KV cache, at its 1/tp of the bandwidth."""
    per_gpu_bytes = (weight_bytes + kv_bytes_per_token * context_tokens) / tp
    return (bandwidth_bytes_per_s / tp) / per_gpu_bytes
