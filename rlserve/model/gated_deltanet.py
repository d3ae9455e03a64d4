"""Gated DeltaNet: the linear-attention layers of Qwen3-Next and Qwen3.5.

Each such layer keeps, per running sequence, a conv state (the last K-1 inputs of its
causal convolution) and a recurrent state (a Dk x Dv matrix per value head) instead of
paged keys and values. The states of all sequences sit in one pool per layer, a slot a
sequence (`bind_states`); the scheduler gives a request its slot for as long as it runs
(rlserve/engine/state_pool.py), and a step says which slot each of its sequences has
(`StateBatch`). A sequence whose chunk starts at position 0 starts from zero state, so a
preempted request that comes back is simply recomputed.

Tensor parallelism splits the layer by key head, as attention is split: each rank takes a
run of key heads and their value heads, their rows of every input projection and their
conv channels (of q, of k and of v), their decay parameters and states, and its columns of
the out projection (row-parallel: one all-reduce a layer).

The recurrences themselves are in rlserve/ops/gated_delta.py (torch, the reference),
rlserve/ops/fla_gated_delta.py (the fla-core Triton kernels, on CUDA when installed) and, for
decode steps, rlserve/ops/triton_gated_delta.py (the state pool updated in place; chosen by
RLSERVE_GDN_DECODE, `decode_in_place`).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from rlserve import envs
from rlserve.distributed import current_tp_group, split_evenly
from rlserve.model.base import Piece, WeightSlot
from rlserve.model.parallel import ColumnParallelLinear, RowParallelLinear, Shard, ShardedModule
from rlserve.ops import fla_gated_delta as fla
from rlserve.ops import gated_delta as ref
from rlserve.ops.kernels import TORCH, Kernels


@dataclass
class StateBatch:
    """Which state slot each of a step's sequences uses (row order), and where its tokens are."""

    slots: torch.Tensor  # int64 [num_seqs], on the model's device
    fresh: torch.Tensor  # bool [num_seqs]: the chunk starts at position 0 (zero state)
    spans: list[tuple[int, int]]  # each sequence's [start, end) of the step's tokens
    fresh_list: list[bool]
    _conv_indices: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = field(default=None, repr=False)

    @property
    def decode(self) -> bool:
        """One token per sequence."""
        return len(self.spans) == (self.spans[-1][1] if self.spans else 0)

    def conv_indices(self, width: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The convolution's gather indices for this step (ops/gated_delta.conv_indices), made
        once and shared by every layer."""
        if self._conv_indices is None:
            self._conv_indices = ref.conv_indices(self.spans, width, device)
        return self._conv_indices

    @classmethod
    def decode_rows(cls, slots: torch.Tensor, fresh: torch.Tensor) -> StateBatch:
        """A decode step's rows given as device tensors (a CUDA graph's static buffers):
        nothing here reads the host, so the step can be captured."""
        n = slots.shape[0]
        return cls(slots, fresh, [(i, i + 1) for i in range(n)], [])

    @classmethod
    def build(cls, slots: list[int], query_start_loc: list[int], starts: list[int],
              device: torch.device) -> StateBatch:
        """`starts`: each sequence's first position this step."""
        spans = list(zip(query_start_loc[:-1], query_start_loc[1:]))
        fresh = [s == 0 for s in starts]
        return cls(torch.tensor(slots, dtype=torch.int64, device=device),
                   torch.tensor(fresh, dtype=torch.bool, device=device), spans, fresh)


@dataclass(frozen=True)
class LinearAttentionShape:
    """A Gated DeltaNet layer's sizes, as the config gives them."""

    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    conv_kernel: int

    @classmethod
    def read(cls, config) -> LinearAttentionShape:
        shape = cls(config.linear_num_key_heads, config.linear_num_value_heads, config.linear_key_head_dim,
                    config.linear_value_head_dim, config.linear_conv_kernel_dim)
        if shape.num_v_heads % shape.num_k_heads:
            raise ValueError(f"linear_num_value_heads ({shape.num_v_heads}) must be a multiple of "
                             f"linear_num_key_heads ({shape.num_k_heads})")
        if shape.conv_kernel < 2:
            raise ValueError(f"linear_conv_kernel_dim: must be >= 2, got {shape.conv_kernel}")
        return shape

    @property
    def key_dim(self) -> int:
        return self.num_k_heads * self.head_k_dim

    @property
    def value_dim(self) -> int:
        return self.num_v_heads * self.head_v_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.value_dim

    def state_bytes(self, conv_dtype: torch.dtype) -> int:
        """One sequence's state in one layer: conv state (model dtype), recurrent state (float32)."""
        return (self.conv_dim * (self.conv_kernel - 1) * conv_dtype.itemsize
                + self.num_v_heads * self.head_k_dim * self.head_v_dim * 4)


def _rows(shards: list[Shard]) -> tuple[Piece, ...]:
    """Runs of one HF tensor's rows (starts in the whole tensor), stacked in order."""
    pieces, offset = [], 0
    for shard in shards:
        pieces.append(Piece(0, shard.start, shard.size, offset))
        offset += shard.size
    return tuple(pieces)


class HeadRowsLinear(ColumnParallelLinear):
    """A projection whose one HF tensor is [q; k; v] of every head: this rank holds its
    heads' rows of each part (`outputs`: starts in the whole tensor, `full` its rows)."""

    def weight_slots(self, module_name: str) -> Iterator[tuple[str, list[tuple[str, WeightSlot]]]]:
        shape = (self.outputs[0].full, self.weight.shape[1])
        yield "weight", [(f"{module_name}.weight", WeightSlot("", shape, _rows(self.outputs)))]


class GatedRMSNorm(nn.Module):
    """RMS-normalise each value head's output, scale by the weight, gate by SiLU(z)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return ((self.weight * x.to(dtype)) * F.silu(z.float())).to(dtype)


class DepthwiseConv(nn.Module):
    """The causal convolution's weight, as transformers' nn.Conv1d holds it: [channels, 1, K],
    no bias (the ops read it as [channels, K]); this rank's channels, `channels` (starts in
    the whole weight)."""

    def __init__(self, channels: list[Shard], width: int):
        super().__init__()
        self.channels = channels
        self.weight = nn.Parameter(torch.empty(sum(c.size for c in channels), 1, width))

    def weight_slots(self, module_name: str) -> Iterator[tuple[str, list[tuple[str, WeightSlot]]]]:
        shape = (self.channels[0].full, 1, self.weight.shape[2])
        yield "weight", [(f"{module_name}.weight", WeightSlot("", shape, _rows(self.channels)))]


class GatedDeltaNet(ShardedModule):
    """One linear-attention layer (this rank's heads). `fused_input`: Qwen3-Next's
    in_proj_qkvz / in_proj_ba, grouped by key head; otherwise Qwen3.5's in_proj_qkv,
    in_proj_z, in_proj_b, in_proj_a."""

    kernels: Kernels = TORCH  # the worker binds its set; the Triton set runs fla-core's kernels
    # Adapters on its projections are refused (model/lora.py reads this): not yet checked
    # against PEFT on these layers. The full-attention layers take them.
    lora_exempt = True

    def __init__(self, config, fused_input: bool):
        super().__init__()
        whole = LinearAttentionShape.read(config)
        tp = current_tp_group()
        if tp.world_size > whole.num_k_heads:
            raise ValueError(f"tensor_parallel_size {tp.world_size}: the linear-attention layers split by key "
                             f"head, at most linear_num_key_heads ({whole.num_k_heads}) ranks")
        k_start, num_k = split_evenly(whole.num_k_heads, tp.world_size, tp.rank)
        r = whole.num_v_heads // whole.num_k_heads  # value heads per key head
        self.shape = s = dataclasses.replace(whole, num_k_heads=num_k, num_v_heads=num_k * r)
        dk, dv, v_start = s.head_k_dim, s.head_v_dim, k_start * r
        # This rank's conv channels: its heads' q, k and v, out of [q | k | v] of every head.
        channels = [Shard(0, k_start * dk, s.key_dim, whole.conv_dim),
                    Shard(0, whole.key_dim + k_start * dk, s.key_dim, whole.conv_dim),
                    Shard(0, 2 * whole.key_dim + v_start * dv, s.value_dim, whole.conv_dim)]
        values = Shard(0, v_start * dv, s.value_dim, whole.value_dim)
        per_head = Shard(0, v_start, s.num_v_heads, whole.num_v_heads)
        self.head_shard = per_head  # dt_bias, A_log
        hidden = config.hidden_size
        self.fused_input = fused_input
        if fused_input:  # grouped by key head: a run of key heads is a run of rows
            group = 2 * dk + 2 * r * dv
            self.in_proj_qkvz = ColumnParallelLinear(
                hidden, [Shard(0, k_start * group, num_k * group, whole.num_k_heads * group)], bias=False)
            self.in_proj_ba = ColumnParallelLinear(
                hidden, [Shard(0, k_start * 2 * r, num_k * 2 * r, whole.num_k_heads * 2 * r)], bias=False)
        else:
            self.in_proj_qkv = HeadRowsLinear(hidden, channels, bias=False)
            self.in_proj_z = ColumnParallelLinear(hidden, [values], bias=False)
            self.in_proj_b = ColumnParallelLinear(hidden, [per_head], bias=False)
            self.in_proj_a = ColumnParallelLinear(hidden, [per_head], bias=False)
        self.conv1d = DepthwiseConv(channels, s.conv_kernel)
        self.dt_bias = nn.Parameter(torch.ones(s.num_v_heads))
        self.A_log = nn.Parameter(torch.zeros(s.num_v_heads))
        self.norm = GatedRMSNorm(s.head_v_dim, config.rms_norm_eps)
        self.out_proj = RowParallelLinear(values, hidden, bias=False)
        act = getattr(config, "hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"hidden_act: Gated DeltaNet layers support silu, got {act!r}")
        # Bound by bind_states: [slots, conv_dim, K-1] and [slots, Hv, Dk, Dv] (float32).
        self.conv_state: torch.Tensor | None = None
        self.recurrent_state: torch.Tensor | None = None

    def weight_shards(self, leaf: str) -> list[Shard | None]:
        return [self.head_shard]  # dt_bias, A_log: a value per value head

    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(the conv's input [T, q|k|v], z [T, Hv, Dv], b [T, Hv], a [T, Hv])."""
        s, n = self.shape, x.shape[0]
        if not self.fused_input:
            z = self.in_proj_z(x).view(n, s.num_v_heads, s.head_v_dim)
            return self.in_proj_qkv(x), z, self.in_proj_b(x), self.in_proj_a(x)
        # Qwen3-Next groups the projections by key head: [q, k, v (r heads), z (r heads)] each,
        # and [b (r), a (r)], r value heads per key head.
        r = s.num_v_heads // s.num_k_heads
        qkvz = self.in_proj_qkvz(x).view(n, s.num_k_heads, -1)
        q, k, v, z = qkvz.split([s.head_k_dim, s.head_k_dim, r * s.head_v_dim, r * s.head_v_dim], dim=-1)
        b, a = self.in_proj_ba(x).view(n, s.num_k_heads, 2 * r).split([r, r], dim=-1)
        mixed = torch.cat([q.reshape(n, -1), k.reshape(n, -1), v.reshape(n, -1)], dim=-1)
        return mixed, z.reshape(n, s.num_v_heads, s.head_v_dim), b.reshape(n, -1), a.reshape(n, -1)

    def forward(self, x: torch.Tensor, states: StateBatch) -> torch.Tensor:
        assert self.conv_state is not None and self.recurrent_state is not None, "bind_states first"
        s, n = self.shape, x.shape[0]
        mixed, z, b, a = self._project(x)
        weight = self.conv1d.weight[:, 0]
        beta = b.float().sigmoid()
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias.float())
        fresh = states.fresh
        if states.decode:
            conv = self.conv_state[states.slots].masked_fill(fresh[:, None, None], 0)
            mixed, conv = ref.causal_conv1d_step(mixed, weight, conv)
            self.conv_state[states.slots] = conv.to(self.conv_state.dtype)
        else:
            mixed = self._conv_prefill(mixed, weight, states)
        q, k, v = mixed.split([s.key_dim, s.key_dim, s.value_dim], dim=-1)
        q = q.view(n, s.num_k_heads, s.head_k_dim)
        k = k.view(n, s.num_k_heads, s.head_k_dim)
        v = v.view(n, s.num_v_heads, s.head_v_dim)
        if states.decode and self.kernels.name != "torch" and decode_in_place():
            from rlserve.ops import triton_gated_delta
            out = triton_gated_delta.decode_step(q, k, v, g, beta, self.recurrent_state, states.slots, fresh)
            return self._output(out, z, x.dtype)
        initial = self.recurrent_state[states.slots].masked_fill(fresh[:, None, None, None], 0)
        if self.kernels.name != "torch" and fla.available():
            out, final = fla.gated_delta_rule(q, k, v, g, beta, initial, states.spans, states.decode)
        else:
            out, final = _reference_delta_rule(q, k, v, g, beta, initial, states)
        self.recurrent_state[states.slots] = final
        return self._output(out, z, x.dtype)

    def _output(self, out: torch.Tensor, z: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        s, n = self.shape, out.shape[0]
        out = self.norm(out.to(dtype).reshape(-1, s.head_v_dim), z.reshape(-1, s.head_v_dim))
        return self.out_proj(out.view(n, s.value_dim))

    def _conv_prefill(self, mixed: torch.Tensor, weight: torch.Tensor, states: StateBatch) -> torch.Tensor:
        """Every sequence of the step in one pass (a fixed number of ops, not a few per sequence)."""
        assert self.conv_state is not None
        initial = self.conv_state[states.slots].masked_fill(states.fresh[:, None, None], 0)
        out, new = ref.causal_conv1d_varlen(mixed, weight, initial, states.conv_indices(weight.shape[1], mixed.device))
        self.conv_state[states.slots] = new.to(self.conv_state.dtype)
        return out


def _reference_delta_rule(q, k, v, g, beta, initial: torch.Tensor, states: StateBatch
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch ops over a step's sequences: one recurrent step for all of them when each
    has one token, else a chunked pass per sequence (a one-token chunk steps)."""
    if states.decode:
        return ref.recurrent_gated_delta_rule(q, k, v, g, beta, initial)
    out = torch.empty(v.shape, dtype=torch.float32, device=v.device)
    final = torch.empty_like(initial, dtype=torch.float32)
    for i, (start, end) in enumerate(states.spans):
        if end - start == 1 and not states.fresh_list[i]:
            o, final[i:i + 1] = ref.recurrent_gated_delta_rule(
                q[start:end], k[start:end], v[start:end], g[start:end], beta[start:end], initial[i:i + 1])
        else:
            o, final[i] = ref.chunk_gated_delta_rule(
                q[start:end], k[start:end], v[start:end], g[start:end], beta[start:end], initial[i])
        out[start:end] = o
    return out, final


@functools.cache
def decode_in_place() -> bool:
    """Whether a decode step on CUDA runs ops/triton_gated_delta.py on the state pool in place
    (RLSERVE_GDN_DECODE=triton) rather than fla-core's kernel (or, without it, the torch
    recurrence). Opt-in until measured against fla-core on a GPU."""
    choice = envs.RLSERVE_GDN_DECODE.get()
    if choice not in (None, "fla", "triton"):
        raise ValueError(f"RLSERVE_GDN_DECODE: fla or triton, got {choice!r}")
    return choice == "triton"


def linear_attention_layers(model: nn.Module) -> list[GatedDeltaNet]:
    return [m for m in model.modules() if isinstance(m, GatedDeltaNet)]


def state_bytes_per_sequence(model: nn.Module, dtype: torch.dtype) -> int:
    """What one running sequence's states take in every linear-attention layer."""
    return sum(layer.shape.state_bytes(dtype) for layer in linear_attention_layers(model))


def bind_states(model: nn.Module, num_slots: int, device: torch.device, dtype: torch.dtype) -> None:
    """Give every linear-attention layer its state pool (num_slots = 0: free them): the
    sequences' `num_slots`, and one more after them, `pad_slot`, where a decode graph's
    padding rows read and write (their outputs are discarded)."""
    for layer in linear_attention_layers(model):
        s = layer.shape
        if num_slots == 0:
            layer.conv_state = layer.recurrent_state = None
            continue
        total = num_slots + 1
        layer.conv_state = torch.zeros(total, s.conv_dim, s.conv_kernel - 1, dtype=dtype, device=device)
        layer.recurrent_state = torch.zeros(total, s.num_v_heads, s.head_k_dim, s.head_v_dim,
                                            dtype=torch.float32, device=device)


def pad_slot(layers: list[GatedDeltaNet]) -> int:
    """The state slot of a decode graph's padding rows (bind_states' last)."""
    state = layers[0].conv_state
    assert state is not None, "bind_states first"
    return state.shape[0] - 1


def copy_states(layers: list[GatedDeltaNet], pairs: list[tuple[int, int]]) -> None:
    """Copy every layer's conv and recurrent state from slot `src` to slot `dst`, for each
    (src, dst) of `pairs` (the prefix cache's loads and saves; no slot is both)."""
    if not pairs or not layers:
        return
    device = layers[0].A_log.device
    src = torch.tensor([p[0] for p in pairs], dtype=torch.int64, device=device)
    dst = torch.tensor([p[1] for p in pairs], dtype=torch.int64, device=device)
    for layer in layers:
        assert layer.conv_state is not None and layer.recurrent_state is not None, "bind_states first"
        layer.conv_state[dst] = layer.conv_state[src]
        layer.recurrent_state[dst] = layer.recurrent_state[src]
