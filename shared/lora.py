"""LoRA adapters in PEFT's format, read and checked without torch: what the api checks before it
serves an adapter, and what the scheduler needs to page one in.

An adapter directory holds `adapter_config.json` (rank `r`, `lora_alpha`, `use_rslora`) and
`adapter_model.safetensors`, whose tensors `...layers.<i>.<module>.<proj>.lora_A.weight` (`[r, in]`)
and `lora_B.weight` (`[out, r]`) add `scaling * B @ A @ x` to the base projection's output.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

# The projections an adapter may change, grouped as the model computes them (q, k and v fused; gate and up fused),
# in the order the worker lays them out.
PROJECTION_GROUPS = (("q_proj", "k_proj", "v_proj"), ("o_proj",), ("gate_proj", "up_proj"), ("down_proj",))
PROJECTIONS = tuple(projection for group in PROJECTION_GROUPS for projection in group)
LLAMA_FAMILY = ("llama", "mistral", "qwen2", "qwen3")
MAX_ADAPTER_NAME_CHARS = 128
_TENSOR = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.\w+)?\.weight$")
_HEADER_LIMIT = 64 << 20
MAX_ADAPTER_BYTES = 2 << 30  # an adapter's weights file; ranks up to 64 on a 70B model's projections fit
_DTYPE_BYTES = {"F32": 4, "F16": 2, "BF16": 2}
# Exponent bits all set: infinity or NaN, by the format's integer view.
_NOT_FINITE = {"F32": ("<u4", 0x7F800000), "F16": ("<u2", 0x7C00), "BF16": ("<u2", 0x7F80)}


class LoraError(ValueError):
    """An adapter that cannot be served on this base model, with the reason."""


@dataclass(slots=True, frozen=True)
class BaseShape:
    """The base model's projection shapes, from its config.json."""

    num_layers: int
    dims: dict[str, tuple[int, int]]  # projection -> (in, out)

    @staticmethod
    def from_config(config: dict[str, Any]) -> BaseShape:
        model_type = config.get("model_type", "")
        if model_type not in LLAMA_FAMILY:
            raise LoraError(
                f"LoRA adapters are served on {', '.join(LLAMA_FAMILY)} models; this one is "
                f"{model_type or 'of no model_type'}"
            )
        hidden, heads = config["hidden_size"], config["num_attention_heads"]
        kv_heads = config.get("num_key_value_heads") or heads
        head_dim = config.get("head_dim") or hidden // heads
        inner = config["intermediate_size"]
        q, kv = heads * head_dim, kv_heads * head_dim
        return BaseShape(
            config["num_hidden_layers"],
            {
                "q_proj": (hidden, q),
                "k_proj": (hidden, kv),
                "v_proj": (hidden, kv),
                "o_proj": (q, hidden),
                "gate_proj": (hidden, inner),
                "up_proj": (hidden, inner),
                "down_proj": (inner, hidden),
            },
        )

    @staticmethod
    def of_model_dir(model_dir: str) -> BaseShape:
        with open(os.path.join(model_dir, "config.json")) as f:
            return BaseShape.from_config(json.load(f))


@dataclass(slots=True, frozen=True)
class AdapterSpec:
    """A checked adapter: where it is, its rank and scaling, and which projections of which layers it changes."""

    name: str
    path: str
    rank: int
    scaling: float
    targets: tuple[str, ...]  # in PROJECTIONS order
    digest: str = ""  # of its files' bytes: its identity wherever it is held


def read_safetensors_header(path: str) -> dict[str, dict[str, Any]]:
    """The tensors' names, dtypes and shapes of a safetensors file, from its JSON header alone."""
    try:
        with open(path, "rb") as f:
            prefix = f.read(8)
            if len(prefix) != 8:
                raise LoraError(f"{path}: not a safetensors file (too short)")
            (length,) = struct.unpack("<Q", prefix)
            if length > _HEADER_LIMIT:
                raise LoraError(f"{path}: not a safetensors file (header of {length} bytes)")
            header = json.loads(f.read(length))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise LoraError(f"{path}: not a readable safetensors file ({exc})") from None
    if not isinstance(header, dict):
        raise LoraError(f"{path}: not a safetensors file")
    header.pop("__metadata__", None)
    return header


def lora_tensor(name: str) -> tuple[int, str, str]:
    """(layer, projection, "A" or "B") of a PEFT tensor name; raises LoraError for any other name."""
    match = _TENSOR.search(name)
    if match is None:
        raise LoraError(f"tensor {name} is not a LoRA A or B matrix of a decoder layer")
    return int(match[1]), match[2], match[3]


def read_adapter(name: str, path: str, roots: Sequence[str] = ()) -> tuple[str, bytes, bytes]:
    """(its real path, adapter_config.json's bytes, adapter_model.safetensors's bytes) of the adapter at `path`; with
    `roots`, the folder and each file must resolve inside one of them (a link out of them is refused)."""
    if not name or len(name) > MAX_ADAPTER_NAME_CHARS or any(c.isspace() for c in name):
        raise LoraError(f"an adapter's name is 1 to {MAX_ADAPTER_NAME_CHARS} characters without spaces: {name!r}")
    if not os.path.isdir(path):
        raise LoraError(f"adapter {name!r}: {path} is not a directory")
    real = os.path.realpath(path)
    config_path = os.path.join(path, "adapter_config.json")
    weights_path = os.path.join(path, "adapter_model.safetensors")
    if not os.path.isfile(config_path):
        raise LoraError(f"adapter {name!r}: {path} has no adapter_config.json")
    if not os.path.isfile(weights_path):
        pickled = os.path.isfile(os.path.join(path, "adapter_model.bin"))
        raise LoraError(
            f"adapter {name!r}: {path} has no adapter_model.safetensors"
            + (" (adapter_model.bin is a pickle, which is never loaded)" if pickled else "")
        )
    files = []
    for file in (config_path, weights_path):
        resolved = os.path.realpath(file)
        if roots and not any(os.path.commonpath([resolved, root]) == root for root in roots):
            raise LoraError(
                f"adapter {name!r}: {os.path.basename(file)} leads outside the folders adapters may be loaded from"
            )
        try:
            with open(resolved, "rb") as f:
                data = f.read(MAX_ADAPTER_BYTES + 1)
        except OSError as exc:
            raise LoraError(f"adapter {name!r}: {os.path.basename(file)} cannot be read ({exc})") from None
        if len(data) > MAX_ADAPTER_BYTES:
            raise LoraError(f"adapter {name!r}: {os.path.basename(file)} is over {MAX_ADAPTER_BYTES >> 30} GiB")
        files.append(data)
    return real, files[0], files[1]


def adapter_digest(config: bytes, weights: bytes) -> str:
    """What an adapter's files hold, as one key: another file, another adapter."""
    digest = hashlib.sha256()
    for part in (config, weights):
        digest.update(len(part).to_bytes(8, "little"))
        digest.update(part)
    return digest.hexdigest()[:32]


def check_adapter(name: str, path: str, base: BaseShape, max_rank: int, roots: Sequence[str] = ()) -> AdapterSpec:
    """The adapter at `path`, read whole and checked against the base model and the largest rank served; raises
    LoraError."""
    real, config, weights = read_adapter(name, path, roots)
    return check_adapter_files(name, real, config, weights, base, max_rank)


def check_adapter_files(
    name: str, path: str, config_bytes: bytes, weights: bytes, base: BaseShape, max_rank: int
) -> AdapterSpec:
    """An adapter from its files' bytes: its config, and every tensor's place, size and values (finite)."""
    try:
        config = json.loads(config_bytes)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise LoraError(f"adapter {name!r}: adapter_config.json is not JSON ({exc})") from None
    if not isinstance(config, dict):
        raise LoraError(f"adapter {name!r}: adapter_config.json is not a JSON object")
    if config.get("peft_type", "LORA") != "LORA":
        raise LoraError(f"adapter {name!r}: peft_type {config.get('peft_type')!r}; only LORA adapters are served")
    for unsupported in ("use_dora", "fan_in_fan_out"):
        if config.get(unsupported):
            raise LoraError(f"adapter {name!r}: {unsupported} is not served")
    if config.get("rank_pattern") or config.get("alpha_pattern"):
        raise LoraError(f"adapter {name!r}: per-module ranks (rank_pattern, alpha_pattern) are not served")
    if config.get("bias", "none") != "none" or config.get("modules_to_save"):
        raise LoraError(f"adapter {name!r}: trained biases or modules_to_save are not served")
    rank, alpha = config.get("r"), config.get("lora_alpha", config.get("r"))
    if type(rank) is not int or rank < 1 or not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        raise LoraError(f"adapter {name!r}: adapter_config.json needs a positive integer r and a numeric lora_alpha")
    if rank > max_rank:
        raise LoraError(f"adapter {name!r}: rank {rank} is over this server's --max-lora-rank {max_rank}")
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank

    found: dict[tuple[int, str], dict[str, list[int]]] = {}
    for tensor, info in _checked_tensors(name, weights).items():
        try:
            layer, projection, which = lora_tensor(tensor)
        except LoraError as exc:
            raise LoraError(f"adapter {name!r}: {exc}") from None
        if projection not in PROJECTIONS:
            raise LoraError(f"adapter {name!r}: target module {projection} is not one of {', '.join(PROJECTIONS)}")
        if not 0 <= layer < base.num_layers:
            raise LoraError(f"adapter {name!r}: layer {layer} is beyond the base model's {base.num_layers}")
        if info.get("dtype") not in ("F32", "F16", "BF16"):
            raise LoraError(f"adapter {name!r}: {tensor} is {info.get('dtype')}; F32, F16 or BF16 are served")
        found.setdefault((layer, projection), {})[which] = list(info.get("shape", []))
    if not found:
        raise LoraError(f"adapter {name!r}: adapter_model.safetensors holds no LoRA weights")
    targets = {projection for _, projection in found}
    for (layer, projection), pair in found.items():
        size_in, size_out = base.dims[projection]
        expected = {"A": [rank, size_in], "B": [size_out, rank]}
        for which in "AB":
            if pair.get(which) != expected[which]:
                raise LoraError(
                    f"adapter {name!r}: layer {layer} {projection} lora_{which} has shape "
                    f"{pair.get(which)}, this base model needs {expected[which]}"
                )
    return AdapterSpec(
        name,
        path,
        rank,
        float(scaling),
        tuple(p for p in PROJECTIONS if p in targets),
        adapter_digest(config_bytes, weights),
    )


def _checked_tensors(name: str, data: bytes) -> dict[str, dict[str, Any]]:
    """A safetensors file's tensors (name -> dtype, shape), each checked to lie within the file, to take the bytes
    its shape says, to overlap no other, and to hold finite values."""
    import numpy as np  # the api's tokenizer brings it; never torch here

    if len(data) < 8:
        raise LoraError(f"adapter {name!r}: adapter_model.safetensors is not a safetensors file (too short)")
    (length,) = struct.unpack("<Q", data[:8])
    if length > min(_HEADER_LIMIT, len(data) - 8):
        raise LoraError(f"adapter {name!r}: adapter_model.safetensors has a header of {length} bytes")
    try:
        header = json.loads(data[8 : 8 + length])
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise LoraError(f"adapter {name!r}: adapter_model.safetensors's header is not JSON ({exc})") from None
    if not isinstance(header, dict):
        raise LoraError(f"adapter {name!r}: adapter_model.safetensors's header is not an object")
    header.pop("__metadata__", None)
    body = memoryview(data)[8 + length :]
    spans = []
    for tensor, info in header.items():
        dtype, shape, offsets = (
            info.get(k) if isinstance(info, dict) else None for k in ("dtype", "shape", "data_offsets")
        )
        if dtype not in _DTYPE_BYTES:
            raise LoraError(f"adapter {name!r}: {tensor} is {dtype}; F32, F16 or BF16 are served")
        if not (
            isinstance(shape, list)
            and all(type(d) is int and d >= 0 for d in shape)
            and isinstance(offsets, list)
            and len(offsets) == 2
            and all(type(o) is int for o in offsets)
        ):
            raise LoraError(f"adapter {name!r}: {tensor} has no valid shape and data_offsets")
        start, end = offsets
        if not 0 <= start <= end <= len(body) or end - start != math.prod(shape) * _DTYPE_BYTES[dtype]:
            raise LoraError(
                f"adapter {name!r}: {tensor}'s data_offsets {offsets} do not hold its {dtype} {shape} within the file"
            )
        spans.append((start, end, tensor))
        view, exponent = _NOT_FINITE[dtype]
        values = np.frombuffer(body[start:end], dtype=view)
        if values.size and bool(((values & exponent) == exponent).any()):
            raise LoraError(f"adapter {name!r}: {tensor} holds values that are not finite (NaN or infinity)")
    spans.sort()
    for (_, end, first), (start, _, second) in zip(spans, spans[1:]):
        if start < end:
            raise LoraError(f"adapter {name!r}: {first} and {second} overlap in the file")
    return header


def parse_lora_modules(values: list[str]) -> dict[str, tuple[str, str | None]]:
    """`--lora-modules` as vLLM takes it: `name=path`, or JSON `{"name": ..., "path": ..., "base_model_name": ...}`;
    returns name -> (path, base model name or None)."""
    modules: dict[str, tuple[str, str | None]] = {}
    for value in values:
        if value.lstrip().startswith("{"):
            try:
                entry = json.loads(value)
            except json.JSONDecodeError as exc:
                raise LoraError(f"--lora-modules: {value!r} is not JSON ({exc})") from None
            if (
                not isinstance(entry, dict)
                or not isinstance(entry.get("name"), str)
                or not isinstance(entry.get("path"), str)
            ):
                raise LoraError(f"--lora-modules: {value!r} needs string fields name and path")
            name, path, parent = entry["name"], entry["path"], entry.get("base_model_name")
        else:
            name, sep, path = value.partition("=")
            if not sep or not name or not path:
                raise LoraError(f"--lora-modules: expected NAME=PATH or JSON, got {value!r}")
            parent = None
        if name in modules:
            raise LoraError(f"--lora-modules: adapter {name!r} is named twice")
        modules[name] = (path, parent)
    return modules


@dataclass(slots=True, frozen=True)
class Part:
    """Where one matrix of an adapter sits in each layer's part of its pages: in which half of the blocks
    (0: where keys go, 1: values), at which value from that half's start, and its shape."""

    region: int
    offset: int
    rows: int
    cols: int


def page_layout(
    rank: int, targets: Sequence[str], dims: Mapping[str, Sequence[int]], half_elements: int
) -> tuple[int, dict[tuple[str, str], Part]]:
    """How many blocks (pages) an adapter takes, and where each of its matrices goes: the A matrices (`[r, in]`)
    in `targets` order, then the B matrices transposed (`[r, out]`), one after the other in each layer's halves of its
    pages, taken as two regions (all pages' first halves, then all second halves; contiguous when the pages
    are consecutive blocks). No matrix straddles the two."""
    sizes = [((p, "A"), rank, dims[p][0]) for p in targets] + [((p, "B"), rank, dims[p][1]) for p in targets]
    total = sum(rows * cols for _, rows, cols in sizes)
    pages = max(1, -(-total // (2 * half_elements)))
    while True:
        capacity = pages * half_elements
        parts: dict[tuple[str, str], Part] = {}
        region = offset = 0
        for key, rows, cols in sizes:
            if offset + rows * cols > capacity and region == 0:
                region, offset = 1, 0
            parts[key] = Part(region, offset, rows, cols)
            offset += rows * cols
        if offset <= capacity:
            return pages, parts
        pages += 1
