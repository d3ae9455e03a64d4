"""Routing replay in the trainer (R3, arXiv 2510.11370): a transformers 5 Qwen3-MoE,
Qwen2-MoE, Mixtral or OLMoE model routes each token to the experts the rollout server
chose for it, so the policy ratio compares the network that sampled with the one trained.

    out = llm_or_server(...)                 # routed_experts: [tokens - 1, layers, k]
    routes = pad_routes(out.routed_experts, len(prompt) + len(output))
    with replay_routes(model, routes):
        logits = model(input_ids).logits

Per token and MoE layer the top-k expert *indices* are forced; their routing *weights*
are recomputed from the trainer's own router logits at those indices (softmax over all
experts in float32, gathered, renormalized where the model renormalizes), so gradients
still reach the router. A row of -1 (a token with no route, e.g. the last sampled token,
which never went through the server's model) keeps the trainer's own routing.

Routes arrive as the server returns them: a numpy array or nested lists of one sequence,
[tokens, num_hidden_layers, top_k], or a batch [batch, tokens, num_hidden_layers, top_k]
matching `input_ids` (padding rows -1). Dense layers' columns are ignored.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn


class RouteShapeError(ValueError):
    """Routes that do not fit the model or the batch they are replayed into."""


def as_routes(routes: torch.Tensor | np.ndarray | Sequence) -> torch.Tensor:
    """Routes as an int64 tensor, from a server's array or JSON lists."""
    if isinstance(routes, torch.Tensor):
        return routes.long()
    return torch.as_tensor(np.asarray(routes, dtype=np.int64))


def pad_routes(routes: torch.Tensor | np.ndarray | Sequence, num_tokens: int) -> torch.Tensor:
    """A sample's routes with -1 rows appended up to `num_tokens` (the server returns a row
    for every token but the last sampled one, as vLLM does)."""
    t = as_routes(routes)
    if t.dim() != 3:
        raise RouteShapeError(f"routes: expected [tokens, layers, top_k], got shape {tuple(t.shape)}")
    if t.shape[0] > num_tokens:
        raise RouteShapeError(f"routes: {t.shape[0]} rows for a sequence of {num_tokens} tokens")
    pad = t.new_full((num_tokens - t.shape[0], *t.shape[1:]), -1)
    return torch.cat([t, pad])


def _router(layer: nn.Module) -> nn.Module | None:
    """The top-k router of a decoder layer's sparse MoE block (transformers 5), if any."""
    for name in ("mlp", "block_sparse_moe"):
        block = getattr(layer, name, None)
        gate = getattr(block, "gate", None) if block is not None else None
        if gate is not None and hasattr(gate, "top_k") and hasattr(gate, "weight"):
            return gate
    return None


def moe_routers(model: nn.Module) -> dict[int, nn.Module]:
    """Decoder layer index -> its router, for every sparse layer of `model`."""
    inner = getattr(model, "model", model)
    layers = getattr(inner, "layers", None)
    if layers is None:
        raise TypeError(f"{type(model).__name__}: no decoder layers found (model.model.layers)")
    routers = {i: r for i, layer in enumerate(layers) if (r := _router(layer)) is not None}
    if not routers:
        raise TypeError(f"{type(model).__name__}: no mixture-of-experts layers to replay routes into")
    return routers


@dataclass
class ReplayStats:
    """What replay changed: of the forced (token, layer) rows, how many the trainer's own
    router would have routed to another set of experts."""

    rows: int = 0
    differing: int = 0
    per_layer: dict[int, tuple[int, int]] = field(default_factory=dict)  # layer -> (rows, differing)

    @property
    def agreement(self) -> float:
        """The fraction of forced rows whose experts the trainer would have picked itself."""
        return 1.0 - self.differing / self.rows if self.rows else 1.0


def _replayed(router: nn.Module, logits: torch.Tensor, own_scores: torch.Tensor, own_ids: torch.Tensor,
              forced: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights, ids): the forced ids where a row has them, weighted by the live router's
    probabilities there (transformers' rule: softmax in float32, renormalized when the
    router renormalizes; Mixtral's always does)."""
    has = forced[:, 0] >= 0
    ids = torch.where(has[:, None], forced.to(own_ids.dtype), own_ids)
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights = probs.gather(1, ids.long())
    if getattr(router, "norm_topk_prob", True):
        weights = weights / weights.sum(dim=-1, keepdim=True)
    weights = weights.to(own_scores.dtype)
    # Rows without a route keep the model's own weights (bit for bit).
    return torch.where(has[:, None], weights, own_scores), ids


@contextmanager
def replay_routes(model: nn.Module, routes: torch.Tensor | np.ndarray | Sequence,
                  stats: ReplayStats | None = None) -> Iterator[ReplayStats]:
    """Within the block, `model`'s forward passes route as `routes` says (see the module's
    docstring); each forward pass must cover exactly the routes' tokens. Yields the
    ReplayStats of the passes run inside it."""
    t = as_routes(routes)
    if t.dim() == 3:
        t = t[None]
    if t.dim() != 4:
        raise RouteShapeError("routes: expected [tokens, layers, top_k] or [batch, tokens, layers, top_k], "
                              f"got shape {tuple(t.shape)}")
    cfg: Any = model.config
    layers, k = int(cfg.num_hidden_layers), int(cfg.num_experts_per_tok)
    experts = int(getattr(cfg, "num_experts", None) or cfg.num_local_experts)
    if t.shape[2] != layers or t.shape[3] != k:
        raise RouteShapeError(f"routes: each token needs [num_hidden_layers={layers}, num_experts_per_tok={k}], "
                              f"got [{t.shape[2]}, {t.shape[3]}]")
    if t.numel() and (int(t.max()) >= experts or int(t.min()) < -1):
        raise RouteShapeError(f"routes: expert ids must be in [0, {experts}) (or -1: no route), got "
                              f"[{int(t.min())}, {int(t.max())}]")
    partial = ((t >= 0).any(-1) & (t < 0).any(-1))
    routers = moe_routers(model)
    if partial.any():
        bad = partial.nonzero()[0].tolist()
        raise RouteShapeError(f"routes: token {bad[1]} of sequence {bad[0]} has a partial row at layer "
                              f"{bad[2]} (a row is all expert ids or all -1)")
    flat = t.reshape(-1, layers, k)
    stats = stats if stats is not None else ReplayStats()

    def hook_for(layer: int):
        def hook(router: nn.Module, _args, output):
            logits, scores, ids = output
            if logits.shape[0] != flat.shape[0]:
                raise RouteShapeError(f"routes: {tuple(t.shape[:2])} (batch, tokens) cover {flat.shape[0]} "
                                      f"tokens, but the forward pass routes {logits.shape[0]}")
            forced = flat[:, layer].to(ids.device)
            weights, new_ids = _replayed(router, logits, scores, ids, forced)
            has = forced[:, 0] >= 0
            differ = int((torch.sort(ids[has], dim=-1).values
                          != torch.sort(forced[has].to(ids.dtype), dim=-1).values).any(-1).sum())
            n = int(has.sum())
            rows, diff = stats.per_layer.get(layer, (0, 0))
            stats.per_layer[layer] = (rows + n, diff + differ)
            stats.rows += n
            stats.differing += differ
            return logits, weights, new_ids
        return hook

    handles = [router.register_forward_hook(hook_for(i)) for i, router in routers.items()]
    try:
        yield stats
    finally:
        for h in handles:
            h.remove()
