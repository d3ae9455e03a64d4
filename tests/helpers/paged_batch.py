"""Batches for the paged-attention kernel tests: a cache with prefixes already stored, this
step's keys and values, a shuffled block table padded with NaN-filled blocks, and the
float32 reference over them."""

from __future__ import annotations

import torch

from helpers.triton_lane import DEVICE
from rlserve.ops import attention as ref

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
SAME = dict(rtol=0, atol=0, equal_nan=True)  # bit for bit, NaNs where NaNs were


def store_kv_cache(*args, **kwargs) -> None:
    """The Triton KV store (rlserve.ops.triton_kv_store), imported once the lane is set."""
    from rlserve.ops import triton_kv_store
    triton_kv_store.store_kv_cache(*args, **kwargs)


def make_batch(seqs, num_heads, num_kv_heads, head_dim, block_size, dtype, gen,
                extra_blocks=7, cache_dtype=None):
    """seqs: list of (cached_prefix_len, query_len); cache_dtype: the cache's, if not dtype.

    Builds a cache whose prefix tokens are already stored, the new keys/values to store this
    step, a shuffled block table padded with ids of NaN-filled blocks, and unused slots
    filled with NaN so any out-of-range read shows up in the output.
    """
    seq_lens = [p + q for p, q in seqs]
    blocks_per_seq = [(s + block_size - 1) // block_size for s in seq_lens]
    max_blocks = max(blocks_per_seq) + 2
    num_blocks = sum(blocks_per_seq) + extra_blocks
    perm = torch.randperm(num_blocks, generator=gen)
    used, spare = perm[:sum(blocks_per_seq)], perm[sum(blocks_per_seq):]
    block_tables = torch.empty((len(seqs), max_blocks), dtype=torch.int32)
    i = 0
    for b, n in enumerate(blocks_per_seq):
        block_tables[b, :n] = used[i:i + n].to(torch.int32)
        pad = spare[torch.randint(len(spare), (max_blocks - n,), generator=gen)]
        block_tables[b, n:] = pad.to(torch.int32)
        i += n

    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(cache_shape, float("nan"), dtype=cache_dtype or dtype)
    v_cache = torch.full(cache_shape, float("nan"), dtype=cache_dtype or dtype)
    scales = {}
    if k_cache.dtype in ref.FP8_DTYPES:  # fp8: a scale per row, NaN where nothing is stored
        scales = {name: torch.full(cache_shape[:3], float("nan")) for name in ("k_scale", "v_scale")}

    def slots(b, positions):
        pos = torch.as_tensor(positions, dtype=torch.int64)
        return block_tables[b].long()[pos // block_size] * block_size + pos % block_size

    new_slots, q_start = [], [0]
    for b, (p, q) in enumerate(seqs):
        if p:
            k = torch.randn(p, num_kv_heads, head_dim, generator=gen).to(dtype)
            v = torch.randn(p, num_kv_heads, head_dim, generator=gen).to(dtype)
            ref.store_kv_cache(k, v, k_cache, v_cache, slots(b, range(p)), **scales)
        new_slots.append(slots(b, range(p, p + q)))
        q_start.append(q_start[-1] + q)
    num_tokens = q_start[-1]
    key = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(dtype)
    value = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(dtype)
    query = torch.randn(num_tokens, num_heads, head_dim, generator=gen).to(dtype)
    dev = DEVICE
    return dict(
        query=query.to(dev), key=key.to(dev), value=value.to(dev),
        k_cache=k_cache.to(dev), v_cache=v_cache.to(dev),
        slot_mapping=torch.cat(new_slots).to(dev),
        query_start_loc=torch.tensor(q_start, dtype=torch.int32, device=dev),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
        block_tables=block_tables.to(dev),
        max_query_len=max(q for _, q in seqs), max_seq_len=max(seq_lens),
        scales={name: t.to(dev) for name, t in scales.items()},
    )


def reference(batch, scale):
    """fp32 reference over a copy of the cache with the new keys stored (fp8 caches: stored
    in fp8 first, rounded and saturated as the kernels store them, then widened)."""
    kc, vc = batch["k_cache"].clone(), batch["v_cache"].clone()
    if kc.dtype in ref.FP8_DTYPES:
        scales = {name: t.clone() for name, t in batch["scales"].items()}
        ref.store_kv_cache(batch["key"], batch["value"], kc, vc, batch["slot_mapping"], **scales)
        kc, vc = ref.dequantize(kc, scales["k_scale"]), ref.dequantize(vc, scales["v_scale"])
    else:
        kc, vc = kc.float(), vc.float()
        ref.store_kv_cache(batch["key"].float(), batch["value"].float(), kc, vc,
                           batch["slot_mapping"])
    return ref.paged_attention(batch["query"].float(), kc, vc, batch["query_start_loc"],
                               batch["seq_lens"], batch["block_tables"], scale)


# Mixed batch: fresh prefill, decode, chunked prefill over a prefix, decode with a long
# prefix, a prefill chunk crossing many blocks, a decode at the very first position, and
# chunks starting just before a 64-key tile boundary (off-by-one in causal masking).
MIXED = [(0, 37), (45, 1), (19, 20), (70, 1), (33, 50), (0, 1), (62, 9), (127, 2)]
