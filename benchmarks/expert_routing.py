"""Which experts a mixture-of-experts model routes tokens to, sampled from its own routers
during a warm-up: throughput.py's bound counts the experts a decode step touches from it."""

from __future__ import annotations

import torch


class RoutingSample:
    """Which experts the model's routers pick for the warm-up's prompt tokens: from each
    expert's share of them, the experts a decode step of B sequences touches, on average
    over the layers (sum over experts of 1 - (1 - share)^B, tokens routed independently)."""

    def __init__(self, llm) -> None:
        from rlserve.model.moe import SparseMoeBlock
        blocks = [m for m in llm.engine.executor.local_runner.model.modules() if isinstance(m, SparseMoeBlock)]
        self.counts = [None] * len(blocks)
        self.tokens = 0
        self.num_experts = blocks[0].gate.out_features if blocks else 0
        self.top_k = blocks[0].top_k if blocks else 0
        # On the block, not its router: the block computes the router's GEMM itself (through
        # its kernels), so the router module is never called. Eager steps only: graphs were
        # captured before the hooks.
        self.hooks = [b.register_forward_pre_hook(self._hook(i, b.top_k)) for i, b in enumerate(blocks)]

    def _hook(self, layer: int, k: int):
        def record(module, inputs) -> None:
            logits = inputs[0] @ module.gate.weight.t()
            ids = torch.topk(logits, k, dim=-1).indices.flatten()
            counts = torch.bincount(ids, minlength=logits.shape[-1]).cpu()
            self.counts[layer] = counts if self.counts[layer] is None else self.counts[layer] + counts
            if layer == 0:
                self.tokens += logits.shape[0]
        return record

    def stop(self) -> None:
        for h in self.hooks:
            h.remove()

    def touched(self, batch: int) -> float:
        layers = [c.double() / self.tokens for c in self.counts if c is not None]
        if not layers:
            return float("nan")
        return sum(float((1 - (1 - share) ** batch).sum()) for share in layers) / len(layers)

    def report(self) -> None:
        e, k = self.num_experts, self.top_k
        sizes = [1, 8, 32, 64, 128, 256]
        print(f"routing of {self.tokens} warm-up tokens: experts a decode step touches per layer, of {e}: " +
              ", ".join(f"{b} seqs {self.touched(b):.1f} (uniform {e * (1 - (1 - k / e) ** b):.1f})" for b in sizes))
