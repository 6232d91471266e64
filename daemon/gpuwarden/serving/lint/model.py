"""What a local model directory says about the model, for the lint: config.json (architecture, hybrid or
sliding-window attention, a sparse-attention indexer, MTP layers, quantization, context), hf_quant_config.json,
whether it ships a generation_config.json or its own reasoning parser, and the parameter count the safetensors
headers give.

A model directory is input from outside, and the daemon reads it as root, so every read is bounded: only
regular files (a FIFO or a device is refused before a byte is read, O_NONBLOCK), links only where they stay
inside the model (or, for a Hugging Face cache snapshot, inside its repository: its files link to ../../blobs),
a size cap per file and in all, a cap on directory entries and shards, and JSON no deeper than MAX_DEPTH.
What cannot be read is said (ModelFacts.why), never guessed. A remote model id has no facts here.

These bounded reads (read_json, headers, entries_of, roots_of) are the one reader of a model directory: bench's
roofline reads weight bytes and the KV size per token through them too.
"""

from __future__ import annotations

import json
import math
import os
import re
import stat
import struct
from dataclasses import dataclass, field
from pathlib import Path
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from ...base import smallfile
from . import hfcache

MAX_JSON_BYTES = 4 * 2**20  # config.json files run to tens of KiB; a long quantization ignore list to a few hundred
MAX_DEPTH = 32  # nesting of config.json (a real one is 4 or 5 deep)
MAX_ENTRIES = 10_000  # directory entries looked at
MAX_SHARDS = 4096  # *.safetensors files whose headers are read
# One safetensors header (the format allows 100 MB; real ones are under 1 MiB) and all of them: bytes of JSON that
# can be a list a 3 bytes (`[[],[],...]`): 32 MiB of it cost 11 s of CPU and 1.7 GB at a start (attacker 9's F5).
MAX_HEADER_BYTES = 4 * 2**20
MAX_HEADERS_TOTAL = 32 * 2**20  # all headers together (DeepSeek-V3's 163 shards: about 16 MB)
MAX_HEADER_TOKENS = 2_000_000  # brackets and commas in all headers (DeepSeek-V3's ~94,000 tensors: about 750,000)
# config.json is another user's file: a number beyond MAX_NUMBER (JSON takes 10**400, NaN, Infinity) is no layer
# count or window, and would overflow the float a rule's comparison or product reads it as; a name or list item
# longer than MAX_NAME is no architecture or module name (those run to ~100 characters), and a rule's regular
# expression matched against 4 MiB of one name could take hours. Either reads as not set.
MAX_NUMBER = 2**63
MAX_NAME = 256
HYBRID_TYPES = ("qwen3_next", "qwen3_5", "qwen3_5_moe", "nemotron_h", "jamba", "bamba", "falcon_h1", "granitemoehybrid",
                "zamba2", "plamo2", "lfm2", "minimax_m2", "kimi_linear", "mamba", "mamba2")
RECURRENT_LAYERS = re.compile(r"(?i)linear|mamba|gdn|deltanet|recurrent|conv")
# vLLM takes a model for DeepSeek-V3.2-style sparse attention (an indexer picking index_topk tokens) when its
# config has index_topk (deepseek_v2.py: is_v32 = hasattr(config, "index_topk")); these config classes give it a
# default where config.json leaves it out.
INDEXER_TYPES = ("deepseek_v32", "glm_moe_dsa")
NEXTN_KEYS = ("num_nextn_predict_layers", "mtp_num_hidden_layers", "num_mtp_layers", "n_mtp_layers")
NOT_PARAMETERS = re.compile(r"(?i)(scale|zero|g_idx|_shape|perm)[^.]*$")  # quantization side tensors
PACKED_DTYPES = {"U8": 8, "I8": 8, "I32": 32, "U32": 32}
DTYPES = {"BOOL", "U8", "I8", "F8_E5M2", "F8_E4M3", "F8_E8M0", "I16", "U16", "F16", "BF16", "I32", "U32",
               "F32", "F64", "I64", "U64", "F4", "F6_E2M3", "F6_E3M2"}


class ModelUnreadable(Exception):
    """One line: why a file of the model directory is not read."""


@dataclass(frozen=True)
class ModelFacts:
    """known False: nothing is known, why says so. Fields a config does not have are None."""

    path: str
    known: bool
    why: str = ""
    architectures: tuple[str, ...] = ()
    model_type: str | None = None
    hybrid: bool | None = None  # recurrent (Mamba, gated delta net) layers beside attention
    sliding_window: int | None = None
    use_sliding_window: bool | None = None
    max_window_layers: int | None = None
    layer_types: tuple[str, ...] | None = None
    num_hidden_layers: int | None = None
    nextn_layers: int | None = None  # multi-token-prediction layers (num_nextn_predict_layers and kin)
    indexer: bool | None = None  # sparse attention's indexer (DeepSeek-V3.2's DSA)
    index_topk: int | None = None  # the tokens the indexer keeps, where config.json says
    quant_method: str | None = None
    quant_bits: int | None = None
    quant_ignore: tuple[str, ...] = ()  # modules the quantization leaves out (config.json and hf_quant_config.json)
    max_position_embeddings: int | None = None
    original_max_position_embeddings: int | None = None  # the trained length under a rope-scaling factor
    rope_factor: float | None = None
    hidden_size: int | None = None
    experts: int | None = None
    params_b: float | None = None  # billions of parameters, from the safetensors headers
    params_note: str = ""
    generation_config: bool | None = None
    reasoning_parsers: tuple[str, ...] = ()  # *reasoning_parser*.py files the checkpoint ships
    stamp: tuple = field(default=(), compare=False)  # the directory's and config.json's mtimes: the cache's key


def not_read(path: str, why: str) -> ModelFacts:
    return ModelFacts(path, False, why)


_memory: dict[str, ModelFacts] = {}


def local_dir(model: str) -> Path | None:
    """The directory model names, when it is a local path (not a remote id like org/name)."""
    if not model.startswith(("/", "./", "../", "~")):
        return None
    return Path(model).expanduser()


def launch_facts(model: str, flags: Sequence[str], env: Mapping[str, str], read: bool = True) -> ModelFacts:
    """The facts of the model a launch loads: serve.model's directory, or for a Hugging Face id the snapshot the
    engine will read in its user's cache (hfcache.locate: env is the engine's environment, flags its flags); what
    is not found says where it looked."""
    if local_dir(model) is not None:
        return model_facts(model, read)
    found = hfcache.locate(model, flags, env)
    if found.path is None:
        where = f" (looked for {found.where})" if found.where else ""
        return not_read(model, f"{found.why}{where}")
    return model_facts(model, read, path=found.path, roots=found.roots)


def model_facts(model: str, read: bool = True, path: Path | None = None,
                roots: tuple[str, ...] = ()) -> ModelFacts:
    """The facts of the model serve.model names (or of path, the folder it was found in), from the cache while the
    directory is unchanged, else read (read False: the daemon's loop, which never waits on a file system: the cache
    or nothing)."""
    path = path or local_dir(model)
    if path is None:
        return not_read(model, f"{model} is not a local directory (a remote id: its config.json is not read)")
    key = f"{model}\0{path}"
    try:
        stamp = _stamp(path)
    except OSError as exc:
        return not_read(model, f"{model}: {exc.strerror or exc}")
    cached = _memory.get(key)
    if cached is not None and cached.stamp == stamp:
        return cached
    if not read:
        return not_read(model, f"{model} is read when the daemon starts or is checked, not on a reload")
    try:
        found = _read(path, model, stamp, roots)
    except ModelUnreadable as exc:
        found = ModelFacts(model, False, str(exc), stamp=stamp)
    _memory[key] = found
    return found


def _stamp(path: Path) -> tuple:
    st = os.stat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise NotADirectoryError(20, "not a directory")
    config = path / "config.json"
    try:
        cst = os.stat(config)
        return st.st_mtime_ns, cst.st_mtime_ns, cst.st_size
    except OSError:
        return st.st_mtime_ns, None, None


# -- bounded reads -------------------------------------------------------------------------------------------

def roots_of(path: Path) -> tuple[str, ...]:
    """Where the model's files may live: the directory, and for a Hugging Face cache snapshot
    (models--org--name/snapshots/REV) the repository directory, whose blobs/ its links point into."""
    real = os.path.realpath(path)
    parent = os.path.dirname(real)
    if os.path.basename(parent) == "snapshots":
        return real, os.path.dirname(parent)
    return (real,)


def inside(real: str, roots: tuple[str, ...]) -> bool:
    return any(real == r or smallfile.under(real, r) for r in roots)


def _open_regular(file: Path, roots: tuple[str, ...]) -> tuple[int, int]:
    """(fd, size) of a regular file inside roots; ModelUnreadable otherwise. O_NONBLOCK: a FIFO put where a file
    should be does not hang the open, and is refused by the fstat."""
    real = os.path.realpath(file)
    if not inside(real, roots):
        raise ModelUnreadable(f"{file} links outside the model directory ({real})")
    try:
        fd = os.open(real, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        raise ModelUnreadable(f"{file}: {exc.strerror}") from None
    # What was opened, checked again: a folder above it swapped for a link between the check and the open (the
    # model is another user's to rename in) opened a root-only file in 2 of 12 tries (attacker 9's F3).
    if not inside(smallfile.opened_path(fd), roots):
        os.close(fd)
        raise ModelUnreadable(f"{file} moved outside the model directory while it was read")
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise ModelUnreadable(f"{file} is not a regular file")
    return fd, st.st_size


def _read_capped(fd: int, size: int) -> bytes:
    chunks, left = [], size
    while left > 0:
        chunk = os.read(fd, min(left, 2**20))
        if not chunk:
            break
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def _depth(value: Any, limit: int) -> int:
    """How deep value nests, counting no further than limit + 1."""
    stack, deepest = [(value, 1)], 0
    while stack:
        item, depth = stack.pop()
        deepest = max(deepest, depth)
        if depth > limit:
            return depth
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else ()
        stack.extend((child, depth + 1) for child in children)
    return deepest


def read_json(file: Path, roots: tuple[str, ...], cap: int = MAX_JSON_BYTES) -> Any:
    fd, size = _open_regular(file, roots)
    try:
        if size > cap:
            raise ModelUnreadable(f"{file} is {size} bytes, more than the {cap} read")
        raw = _read_capped(fd, cap)
    finally:
        os.close(fd)
    return _parse_json(raw, str(file))


def _parse_json(raw: bytes, what: str) -> Any:
    try:
        value = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise ModelUnreadable(f"{what} is not JSON ({str(exc)[:80]})") from None
    if _depth(value, MAX_DEPTH) > MAX_DEPTH:
        raise ModelUnreadable(f"{what} nests deeper than {MAX_DEPTH} levels")
    return value


# -- the facts -----------------------------------------------------------------------------------------------

def _read(path: Path, model: str, stamp: tuple, roots: tuple[str, ...] = ()) -> ModelFacts:
    """roots: where every file read must be (a Hugging Face snapshot's, as hfcache.locate checked them: a folder
    swapped for a link since is not followed out of them); else the folder's own (roots_of)."""
    roots = roots or roots_of(path)
    names = entries_of(path, roots)
    if "config.json" not in names:
        raise ModelUnreadable(f"{model} has no config.json")
    config = read_json(path / "config.json", roots)
    if not isinstance(config, dict):
        raise ModelUnreadable(f"{path / 'config.json'} is not a JSON object")
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
    lm = {**config, **text}  # a multimodal config nests the language model's under text_config
    quant = config.get("quantization_config") if isinstance(config.get("quantization_config"), dict) else {}
    hf_quant = {}
    if "hf_quant_config.json" in names:
        raw = read_json(path / "hf_quant_config.json", roots)
        hf_quant = raw.get("quantization", raw) if isinstance(raw, dict) else {}
        hf_quant = hf_quant if isinstance(hf_quant, dict) else {}
    method = _text(quant.get("quant_method")) or _text(hf_quant.get("quant_algo"))
    bits = _quant_bits(quant, hf_quant)
    rope = lm.get("rope_scaling") or lm.get("rope_parameters") or {}
    rope = rope if isinstance(rope, dict) else {}
    layer_types = lm.get("layer_types")
    layer_types = tuple(t for t in map(str, layer_types) if len(t) <= MAX_NAME) if isinstance(layer_types, list) \
        else None
    params, note = _params(path, names, roots, bits)
    return ModelFacts(
        model, True, "",
        architectures=_names_in(config.get("architectures")),
        model_type=_text(config.get("model_type")),
        hybrid=_hybrid(config, lm, layer_types),
        sliding_window=_int(lm.get("sliding_window")),
        use_sliding_window=lm.get("use_sliding_window") if isinstance(lm.get("use_sliding_window"), bool) else None,
        max_window_layers=_int(lm.get("max_window_layers")),
        layer_types=layer_types,
        num_hidden_layers=_int(lm.get("num_hidden_layers")),
        nextn_layers=next((_int(lm[k]) for k in NEXTN_KEYS if _int(lm.get(k)) is not None), None),
        indexer="index_topk" in lm or (_text(config.get("model_type")) or "") in INDEXER_TYPES,
        index_topk=_int(lm.get("index_topk")),
        quant_method=method,
        quant_bits=bits,
        quant_ignore=_ignored(quant) + _ignored(hf_quant),
        max_position_embeddings=_int(lm.get("max_position_embeddings")),
        original_max_position_embeddings=_int(rope.get("original_max_position_embeddings")),
        rope_factor=_float(rope.get("factor")),
        hidden_size=_int(lm.get("hidden_size")),
        experts=next((_int(lm[k]) for k in ("num_experts", "n_routed_experts", "num_local_experts")
                      if _int(lm.get(k)) is not None), None),
        params_b=params,
        params_note=note,
        generation_config="generation_config.json" in names,
        reasoning_parsers=tuple(sorted(n for n in names if n.endswith(".py") and "reasoning_parser" in n)),
        stamp=stamp,
    )


def entries_of(path: Path, roots: tuple[str, ...] = ()) -> set[str]:
    """The folder's entry names (at most MAX_ENTRIES); with roots, only where the folder opened is inside them."""
    names = set()
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as exc:
        raise ModelUnreadable(f"{path}: {exc.strerror}") from None
    try:
        if roots and not inside(smallfile.opened_path(fd), roots):
            raise ModelUnreadable(f"{path} moved outside the model directory while it was read")
        with os.scandir(fd) as entries:
            for i, entry in enumerate(entries):
                if i >= MAX_ENTRIES:
                    raise ModelUnreadable(f"{path} has more than {MAX_ENTRIES} entries")
                names.add(entry.name)
    except OSError as exc:
        raise ModelUnreadable(f"{path}: {exc.strerror}") from None
    finally:
        os.close(fd)
    return names


def _text(value: Any) -> str | None:
    return value.lower() if isinstance(value, str) and value and len(value) <= MAX_NAME else None


def _names_in(value: Any) -> tuple[str, ...]:
    """The names a list of config.json gives, those that can be names (MAX_NAME)."""
    return tuple(v for v in value if isinstance(v, str) and len(v) <= MAX_NAME) if isinstance(value, list) else ()


def _int(value: Any) -> int | None:
    ok = isinstance(value, int) and not isinstance(value, bool) and abs(value) <= MAX_NUMBER
    return value if ok else None


def _float(value: Any) -> float | None:
    if _int(value) is not None:
        return float(value)
    return value if isinstance(value, float) and math.isfinite(value) else None  # NaN, Infinity: not set


def _hybrid(config: dict, lm: dict, layer_types: tuple[str, ...] | None) -> bool:
    if layer_types and any(RECURRENT_LAYERS.search(t) for t in layer_types):
        return True
    pattern = lm.get("hybrid_override_pattern")
    if isinstance(pattern, str) and "M" in pattern:  # Nemotron-H: M for a Mamba layer
        return True
    return (_text(config.get("model_type")) or "") in HYBRID_TYPES


def _ignored(quant: dict) -> tuple[str, ...]:
    out = []
    for key in ("ignore", "ignored_layers", "modules_to_not_convert", "exclude_modules"):
        value = quant.get(key)
        out += _names_in(value)
    return tuple(out)


def _quant_bits(quant: dict, hf_quant: dict) -> int | None:
    """The weights' bits where the quantization says: bits/num_bits, or a 4-bit float format by name."""
    for source in (quant, hf_quant):
        for key in ("bits", "num_bits", "weight_bits", "w_bit"):
            if _int(source.get(key)):
                return source[key]
        groups = source.get("config_groups")
        if isinstance(groups, dict):
            for group in groups.values():
                weights = group.get("weights") if isinstance(group, dict) else None
                if isinstance(weights, dict) and _int(weights.get("num_bits")):
                    return weights["num_bits"]
        names = " ".join(str(source.get(k, "")) for k in ("quant_method", "quant_algo", "format")).lower()
        if re.search(r"fp4|int4|w4a", names):
            return 4
    return None


def _params(path: Path, names: set[str], roots: tuple[str, ...], bits: int | None) -> tuple[float | None, str]:
    """(billions of parameters, how it was counted) from the headers of the *.safetensors files: elements of every
    tensor but quantization scales and zero points, packed integer weights unpacked by the quantization's bits."""
    shards = sorted(n for n in names if n.endswith(".safetensors"))
    if not shards:
        return None, "no *.safetensors files"
    if len(shards) > MAX_SHARDS:
        return None, f"more than {MAX_SHARDS} *.safetensors files"
    try:
        total = sum(_elements(header, bits, name) for name, header in headers(path, shards, roots))
    except ModelUnreadable as exc:
        return None, str(exc)
    return total / 1e9, f"{len(shards)} safetensors header(s)"


def headers(path: Path, shards: list[str], roots: tuple[str, ...]) -> Iterator[tuple[str, dict]]:
    """(name, header) of each safetensors file named, within MAX_HEADER_BYTES each and MAX_HEADERS_TOTAL in all,
    and MAX_HEADER_TOKENS JSON values and separators in all (counted before a byte is parsed)."""
    budget, tokens = MAX_HEADERS_TOTAL, [MAX_HEADER_TOKENS]
    for name in shards:
        header, length = _header(path / name, roots, budget, tokens)
        budget -= length
        yield name, header


def _header(file: Path, roots: tuple[str, ...], budget: int, tokens: list[int]) -> tuple[dict, int]:
    fd, size = _open_regular(file, roots)
    try:
        raw = _read_capped(fd, 8)
        if len(raw) != 8:
            raise ModelUnreadable(f"{file}: too short for a safetensors file")
        (length,) = struct.unpack("<Q", raw)
        if length > min(MAX_HEADER_BYTES, budget) or length > size - 8:
            raise ModelUnreadable(f"{file}: a header of {length} bytes is more than is read")
        raw = _read_capped(fd, length)
        # bytes bound the memory; the parse's CPU goes with the values: 32 MiB of `[[],[],...]` in eight 4 MiB
        # headers still cost 12 s (attacker 10's F4). A tensor's entry is about 8 of them.
        tokens[0] -= raw.count(b"[") + raw.count(b"{") + raw.count(b",")
        if tokens[0] < 0:
            raise ModelUnreadable(f"{file}: the headers hold more than {MAX_HEADER_TOKENS} JSON values in all")
        header = _parse_json(raw, f"{file}'s header")
    finally:
        os.close(fd)
    if not isinstance(header, dict):
        raise ModelUnreadable(f"{file}'s header is not a JSON object")
    return header, length


def _elements(header: dict, bits: int | None, name: str) -> int:
    total = 0
    for tensor, entry in header.items():
        if tensor == "__metadata__" or NOT_PARAMETERS.search(tensor):
            continue
        shape = entry.get("shape") if isinstance(entry, dict) else None
        if not isinstance(shape, list) or entry.get("dtype") not in DTYPES or \
                not all(_int(d) is not None and d >= 0 for d in shape):
            raise ModelUnreadable(f"{name}: tensor {tensor[:80]!r} has no dtype and shape")
        count = math.prod(shape)
        width = PACKED_DTYPES.get(entry["dtype"])
        if width and bits and bits < 8:
            count *= width // bits  # two FP4 values a byte, eight 4-bit integers an int32
        total += count
    return total
