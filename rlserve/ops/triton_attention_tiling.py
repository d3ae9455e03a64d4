"""How a paged_attention call is cut into programs, from host-side sizes alone (no device
reads, so a decode step can be captured in a CUDA graph): the tile shape (tuned on an H200),
flash-decoding KV splits when too few programs would fill the GPU, and the batch-invariant
mode's one tile shape.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton

from rlserve.ops.attention import FP8_DTYPES


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


@functools.cache
def _has_fp8_cvt(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index) >= (8, 9)


def _cuda_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def _fp8_cvt(device: torch.device) -> bool:
    """Whether `device` has the fp8-to-f16x2 conversion instruction (sm_89 and later)."""
    return device.type == "cuda" and _has_fp8_cvt(_cuda_index(device))


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 16  # interpreter runs: any small number
    return _num_sms(_cuda_index(device))


# Shared memory the decode tile's pipelined K/V stages may take (an H200 SM has 228 KB).
_STAGES_BYTES = 200 * 1024


def _pick_config(max_query_len: int, group_pad: int, head_dim: int, num_seqs: int,
                 block_size: int, itemsize: int) -> dict:
    """Tile shape from host-side sizes only (no device reads); tuned on an H200, bf16
    (benchmarks/decode_sweep.py). A CUDA graph is captured per batch size, so the decode
    tile may follow the number of sequences."""
    if max_query_len * group_pad > 16:  # prefill and mixed steps
        return dict(BLOCK_M=max(64, group_pad), BLOCK_N=64, num_warps=4, num_stages=2)
    # Decode (and tiny chunks): memory bound, small M.
    if itemsize == 1:  # fp8: wide key tiles, the best at every batch size measured
        block_n, warps, stages = 128, 4, 2
    elif block_size >= 128:  # a key tile inside one block: one block-table read per tile
        block_n, warps, stages = 64, 4, 2
    elif num_seqs > 160:  # many programs: smaller tiles, more of them resident per SM
        block_n, warps, stages = 32, 2, 3
    elif num_seqs > 96:
        block_n, warps, stages = 64, 2, 3
    else:  # few, long sequences late in a run: larger tiles per program
        block_n, warps, stages = 128, 4, 3
    # Wider heads or float32 caches: narrower key tiles, so the stages still fit.
    block_d = triton.next_power_of_2(head_dim)
    while block_n > 16 and 2 * block_n * block_d * itemsize * stages > _STAGES_BYTES:
        block_n //= 2
    return dict(BLOCK_M=max(16, group_pad), BLOCK_N=block_n, num_warps=warps, num_stages=stages)


def invariant_config(group_pad: int, head_dim: int, itemsize: int) -> dict:
    """The batch-invariant mode's one tile shape, from the model's shapes alone: the same
    for decode, prefill and chunks, whatever the batch (so the same dot instructions and
    the same key tiles for every row). 64 keys a tile; wider heads narrower tiles, as
    _pick_config fits its stages."""
    block_n, stages = 64, 2
    block_d = triton.next_power_of_2(head_dim)
    while block_n > 16 and 2 * block_n * block_d * itemsize * stages > _STAGES_BYTES:
        block_n //= 2
    return dict(BLOCK_M=max(64, group_pad), BLOCK_N=block_n, num_warps=4, num_stages=stages)


def _pick_splits(num_seqs: int, num_kv_heads: int, q_tiles: int, max_ctx: int,
                 device: torch.device) -> int:
    """Flash-decoding: split the keys when too few programs would fill the GPU."""
    if q_tiles != 1 or max_ctx <= 1024:
        return 1
    programs = num_seqs * num_kv_heads
    target = 2 * _sm_count(device)
    if programs >= target:
        return 1
    splits = min(triton.cdiv(target, programs), triton.cdiv(max_ctx, 512), 16)
    return max(1, splits)


class Tiling(NamedTuple):
    """How one paged_attention call is cut into programs (see tiling)."""

    grid: tuple[int, int, int]
    splits: int  # KV splits per (query tile, sequence, kv head); > 1: partial results merged after
    block_d: int  # head_dim padded to a power of two
    constants: dict  # the kernel's compile-time constants and launch options


def tiling(query: torch.Tensor, k_cache: torch.Tensor, num_seqs: int, max_query_len: int,
           max_seq_len: int, num_kv_splits: int | None, config: dict | None,
           invariant: bool = False) -> Tiling:
    """Tiles, KV splits and grid of a call: BLOCK_Q tokens of a query tile times the query
    heads of one kv head (padded to a power of two) make a tile's BLOCK_M rows."""
    num_heads, head_dim = query.shape[1:]
    block_size, num_kv_heads = k_cache.shape[1:3]
    group = num_heads // num_kv_heads
    group_pad = triton.next_power_of_2(group)
    if invariant:
        # `config` here only from benchmarks/invariant_tiles.py, which checks other shapes' bits.
        cfg = dict(config) if config else invariant_config(group_pad, head_dim, k_cache.element_size())
        num_kv_splits = 1
    elif config:
        cfg = dict(config)
    else:
        cfg = _pick_config(max_query_len, group_pad, head_dim, num_seqs, block_size, k_cache.element_size())
    block_m, block_n = cfg.pop("BLOCK_M"), cfg.pop("BLOCK_N")
    block_q = max(1, block_m // group_pad)
    block_m = block_q * group_pad
    q_tiles = triton.cdiv(max_query_len, block_q)
    if num_kv_splits is None:
        num_kv_splits = _pick_splits(num_seqs, num_kv_heads, q_tiles, max_seq_len, query.device)
    splits = max(1, int(num_kv_splits))
    block_d = triton.next_power_of_2(head_dim)
    kv_fp8 = k_cache.dtype in FP8_DTYPES
    # The dots' operand type; fp8 caches: float16 for half-precision queries (see the kernel).
    compute = k_cache.dtype
    if kv_fp8:
        compute = torch.float32 if query.dtype == torch.float32 else torch.float16
    heads_first = cfg.pop("HEADS_FIRST", True)
    grid = ((num_kv_heads, q_tiles * splits, num_seqs) if heads_first
            else (q_tiles * splits, num_seqs, num_kv_heads))
    constants = dict(
        GROUP=group, GROUP_PAD=group_pad, BLOCK_Q=block_q, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_SIZE=block_size, HEAD_DIM=head_dim, BLOCK_D=block_d, NUM_SPLITS=splits,
        PRECISION="ieee" if compute == torch.float32 else "tf32",
        # Triton's CPU interpreter mis-evaluates bf16 dots; it gets fp32 operands instead.
        DOT_F32=query.device.type == "cpu" and compute == torch.bfloat16, KV_FP8=kv_fp8,
        Q_F16=kv_fp8 and compute == torch.float16, DECODE=max_query_len == 1 and not invariant,
        INVARIANT=invariant,
        V_ASM=kv_fp8 and compute == torch.float16 and _fp8_cvt(query.device),
        HEADS_FIRST=heads_first, **cfg)
    return Tiling(grid, splits, block_d, constants)

