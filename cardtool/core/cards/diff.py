"""`cards diff A B`: what card B changes of card A — the manifest fields that differ (with `extends` resolved), and for
each component and adapter whose weights differ, by how much: per tensor the relative change ‖B − A‖ / ‖A‖ (Frobenius
norms) and the largest absolute change, and over the whole file the same ratio of the summed squares — what an RL run
or a distillation moved, and where. Read from the raw safetensors layout a chunk at a time, without a framework: any
float dtype (bf16 too), any file size, and a light command (no torch)."""

from __future__ import annotations

import json
import math
import struct

import numpy as np

from cardtool.core.cards.loader import Card
from cardtool.core.cards.weight_files import FLOAT_DTYPES, RAW_VIEWS, read_header, sha256_file

__all__ = ["diff_cards"]

_IGNORED = ("sha256", "weights")  # a weights file's name and hash: its content is compared below, not its name
_CHUNK = 1 << 20  # elements read at a time from each file


def diff_cards(a: Card, b: Card, top: int = 5) -> dict:
    """The manifest changes (dotted path → [A's value, B's]) and, per component and adapter with weights, its status
    (`same`: every tensor holds the same values, whatever the files' metadata or layout; `changed`, `added`,
    `removed`) and for a changed one the tensors that differ, `top` of them listed by relative change."""
    before, after = _flat(a.manifest.to_json()), _flat(b.manifest.to_json())
    manifest = {key: [before.get(key), after.get(key)] for key in sorted({*before, *after})
                if before.get(key) != after.get(key)}
    weights = []
    for section in ("components", "adapters"):
        old, new = getattr(a.manifest, section), getattr(b.manifest, section)
        for name in sorted({*old, *new}):
            has_a = name in old and old[name].weights is not None
            has_b = name in new and new[name].weights is not None
            if has_a or has_b:
                weights.append(_weights(section, name, a if has_a else None, b if has_b else None, top))
    return {"a": a.id, "b": b.id, "manifest": manifest, "weights": weights}


def _flat(value, prefix: str = "") -> dict:
    if isinstance(value, dict):
        out = {}
        for key, item in value.items():
            if key not in _IGNORED:
                out |= _flat(item, f"{prefix}{key}.")
        return out
    return {prefix[:-1]: value}


def _weights(section: str, name: str, a: Card | None, b: Card | None, top: int) -> dict:
    entry = {"section": section, "name": name}
    if a is None or b is None:
        return {**entry, "status": "added" if a is None else "removed"}
    path_a, path_b = a.weights_file(name, section), b.weights_file(name, section)
    if path_a.resolve() == path_b.resolve() or sha256_file(path_a) == sha256_file(path_b):
        return {**entry, "status": "same"}
    (header_a, _), (header_b, _) = read_header(path_a), read_header(path_b)
    common = sorted(set(header_a) & set(header_b))
    reshaped = [t for t in common if header_a[t][1] != header_b[t][1]]
    rows, total_a, total_delta = [], 0.0, 0.0
    with path_a.open("rb") as fa, path_b.open("rb") as fb:
        layout_a, layout_b = _layout(fa), _layout(fb)
        for tensor in (t for t in common if t not in reshaped):
            if header_a[tensor][0] in FLOAT_DTYPES and header_b[tensor][0] in FLOAT_DTYPES:
                norm_a, norm_delta, largest = _compare(fa, layout_a, fb, layout_b, tensor)
                total_a, total_delta = total_a + norm_a, total_delta + norm_delta
                if norm_delta > 0 or not math.isfinite(norm_delta):
                    rows.append({"tensor": tensor, "relative_change": _ratio(norm_delta, norm_a),
                                 "max_abs_change": _finite(largest)})
            elif _raw(fa, layout_a, tensor) != _raw(fb, layout_b, tensor):  # integers, booleans: equal or not
                rows.append({"tensor": tensor, "relative_change": None, "max_abs_change": None})
    if not rows and set(header_a) == set(header_b) and not reshaped:  # another file, the same values
        return {**entry, "status": "same"}
    # largest first; a tensor with no ratio (zero in A, as a LoRA's B starts) before every other
    rows.sort(key=lambda r: -math.inf if r["relative_change"] is None else -r["relative_change"])
    return {**entry, "status": "changed", "tensors": len(set(header_a) | set(header_b)),
            "tensors_changed": len(rows), "relative_change": _ratio(total_delta, total_a),
            "only_in_a": sorted(set(header_a) - set(header_b)), "only_in_b": sorted(set(header_b) - set(header_a)),
            "reshaped": reshaped, "largest": rows[:top]}


def _layout(f) -> tuple[int, dict]:
    (length,) = struct.unpack("<Q", f.read(8))
    return 8 + length, json.loads(f.read(length))


def _compare(fa, layout_a, fb, layout_b, tensor: str) -> tuple[float, float, float]:
    """(Σ A², Σ (B − A)², max |B − A|) of one tensor, in float64, read a chunk at a time from both files."""
    readers = [_values(f, start, header[tensor]) for f, (start, header) in ((fa, layout_a), (fb, layout_b))]
    norm_a = norm_delta = largest = 0.0
    for x, y in zip(*readers, strict=True):
        delta = y - x
        norm_a += float(np.dot(x, x))
        norm_delta += float(np.dot(delta, delta))
        largest = max(largest, float(np.max(np.abs(delta)))) if delta.size else largest
    return norm_a, norm_delta, largest


def _raw(f, layout: tuple[int, dict], tensor: str) -> tuple[str, bytes]:
    """A non-float tensor's dtype and bytes (such tensors are small: step counters, indices)."""
    start, header = layout
    begin, end = header[tensor]["data_offsets"]
    f.seek(start + begin)
    return header[tensor]["dtype"], f.read(end - begin)


def _values(f, start: int, entry: dict):
    """A tensor's values as float64 chunks of _CHUNK elements (the last shorter); bf16 widened exactly."""
    dtype = entry["dtype"]
    size = np.dtype(RAW_VIEWS[dtype]).itemsize
    begin, end = entry["data_offsets"]
    for at in range(begin, end, _CHUNK * size):
        f.seek(start + at)
        raw = np.frombuffer(f.read(min(_CHUNK * size, end - at)), dtype=RAW_VIEWS[dtype])
        yield (raw.astype(np.uint32) << 16).view(np.float32).astype(np.float64) if dtype == "BF16" \
            else raw.astype(np.float64)


def _ratio(delta: float, base: float) -> float | None:
    """‖Δ‖ / ‖A‖ from their squares; None where it is not a number (A all zero while B is not, or NaN weights)."""
    if not (math.isfinite(delta) and math.isfinite(base)) or base == 0:
        return 0.0 if delta == 0 and math.isfinite(base) else None
    return math.sqrt(delta / base)


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None
