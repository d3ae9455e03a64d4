"""Launch shapes of the fused MoE, tuned per card and per expert shape.

A decode step (a few pairs per expert) wants short blocks and long K tiles to stream the
experts' weights; a prefill chunk (hundreds of pairs per expert) is compute-bound and wants
large tiles and more warps. No one shape serves both, nor every card. `benchmarks/moe_tune.py`
times candidate shapes on the card it runs on and writes a table here,

    rlserve/ops/moe_configs/<card>/E<experts>-H<hidden>-I<expert width>-<dtype>.json

mapping token counts to a launch shape ({"BLOCK_M", "BLOCK_N", "BLOCK_K", "warps", "stages"},
and "down": the same keys for the down projection where it differs). A step takes the entry of
the smallest count at or above its own (the largest past the end); with no table for its card
and shape the built-in defaults of triton_moe.py run. A table changes which tiles add which
products, never what is summed: outputs agree to rounding, and the batch-invariant mode keeps
its one fixed shape.
"""

from __future__ import annotations

import bisect
import functools
import json
import re
from pathlib import Path

import torch

TABLES = Path(__file__).with_name("moe_configs")
_LAUNCH_KEYS = {"BLOCK_M", "BLOCK_N", "BLOCK_K", "warps", "stages"}


def card_dir(device_name: str) -> str:
    """A card's folder name: its CUDA name with every run of other characters as one '_'."""
    return re.sub(r"[^A-Za-z0-9.-]+", "_", device_name).strip("_")


def table_path(device_name: str, experts: int, hidden: int, inter: int, dtype: torch.dtype) -> Path:
    dtype_name = str(dtype).removeprefix("torch.")
    return TABLES / card_dir(device_name) / f"E{experts}-H{hidden}-I{inter}-{dtype_name}.json"


def check_table(table: dict, where: str) -> dict[int, dict]:
    """A table read from JSON, keys as token counts, sorted; an unknown key is refused by name
    (BLOCK_M is the blocks' rows, shared by both projections: never under "down")."""
    out = {}
    for tokens, cfg in table.items():
        bad = sorted(set(cfg) - _LAUNCH_KEYS - {"down"})
        bad += [f"down.{k}" for k in sorted(set(cfg.get("down", {})) - (_LAUNCH_KEYS - {"BLOCK_M"}))]
        if bad:
            raise ValueError(f"{where}: entry {tokens}: unknown keys {bad} (launch keys: {sorted(_LAUNCH_KEYS)})")
        out[int(tokens)] = cfg
    return dict(sorted(out.items()))


@functools.lru_cache(maxsize=16)
def _device_name(index: int) -> str:
    return torch.cuda.get_device_name(index)


@functools.lru_cache(maxsize=64)
def _table(index: int, experts: int, hidden: int, inter: int,
           dtype: torch.dtype) -> tuple[tuple[int, ...], tuple[dict, ...]] | None:
    """Read once per shape (every MoE layer of every eager step asks)."""
    path = table_path(_device_name(index), experts, hidden, inter, dtype)
    if not path.is_file():
        return None
    table = check_table(json.loads(path.read_text()), str(path))
    return tuple(table), tuple(table.values())


def tuned(device: torch.device, experts: int, hidden: int, inter: int, dtype: torch.dtype,
          num_tokens: int) -> dict | None:
    """The launch shape the card's table gives `num_tokens` tokens, or None (no table)."""
    if device.type != "cuda":
        return None
    found = _table(device.index or 0, experts, hidden, inter, dtype)
    if found is None:
        return None
    counts, configs = found
    return configs[min(bisect.bisect_left(counts, num_tokens), len(counts) - 1)]
