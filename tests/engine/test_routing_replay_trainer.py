"""The trainer's half of routing replay (rlserve.moe_replay) on transformers 5 models
(CPU, float32): forced routes reach the experts exactly, for Qwen3-MoE, Qwen2-MoE,
Mixtral and OLMoE; the routing weights come from the live router logits, so gradients reach
the router; -1 rows keep the model's own routing; routes of the wrong shape are refused
by name; and routes returned by rlserve make transformers pick the server's experts."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from helpers.checkpoints import seeded_wide_model
from helpers.moe import ARCHS, moe_config
from rlserve import LLM, SamplingParams
from rlserve.moe_replay import RouteShapeError, moe_routers, pad_routes, replay_routes


@pytest.fixture(scope="module", params=ARCHS)
def hf(request):
    return seeded_wide_model(moe_config(request.param)).eval()


def experts_seen(model) -> tuple[dict[int, torch.Tensor], list]:
    """Layer -> the top-k ids its experts module was called with (recorded by hooks)."""
    seen: dict[int, torch.Tensor] = {}
    handles = []
    for i, layer in enumerate(model.model.layers):
        experts = getattr(layer.mlp, "experts", None)
        if experts is None or i not in moe_routers(model):
            continue

        def record(_m, args, i=i):
            seen[i] = args[1].detach().clone()
        handles.append(experts.register_forward_pre_hook(record))
    return seen, handles


def random_routes(model, tokens: int, seed: int = 0) -> torch.Tensor:
    cfg = model.config
    experts = getattr(cfg, "num_experts", None) or cfg.num_local_experts
    g = torch.Generator().manual_seed(seed)
    out = torch.full((tokens, cfg.num_hidden_layers, cfg.num_experts_per_tok), -1)
    for layer in moe_routers(model):
        out[:, layer] = torch.stack([torch.randperm(experts, generator=g)[:cfg.num_experts_per_tok]
                                     for _ in range(tokens)])
    return out


def test_forced_routes_reach_the_experts_and_gradients_reach_the_router(hf):
    ids = torch.randint(2, hf.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    routes = torch.stack([random_routes(hf, 9, seed) for seed in (1, 2)])  # [batch, tokens, layers, k]
    seen, handles = experts_seen(hf)
    try:
        with replay_routes(hf, routes) as stats:
            logits = hf(ids).logits
    finally:
        for h in handles:
            h.remove()
    flat = routes.reshape(-1, *routes.shape[2:])
    for layer, got in seen.items():
        assert torch.equal(got.long(), flat[:, layer]), layer
    assert stats.rows == flat.shape[0] * len(seen) and stats.differing > 0  # random routes mostly differ
    logits.logsumexp(-1).sum().backward()
    for layer, router in moe_routers(hf).items():
        assert router.weight.grad is not None and router.weight.grad.abs().sum() > 0, layer
    hf.zero_grad()


def test_rows_of_minus_one_keep_the_models_own_routing(hf):
    ids = torch.randint(2, hf.config.vocab_size, (1, 7), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        own = hf(ids).logits
        none = torch.full((7, hf.config.num_hidden_layers, hf.config.num_experts_per_tok), -1)
        with replay_routes(hf, none) as stats:
            same = hf(ids).logits
    assert torch.equal(own, same) and stats.rows == 0


def test_routes_of_the_wrong_shape_are_refused_by_name(hf):
    cfg = hf.config
    ids = torch.tensor([[5, 6, 7]])
    good = random_routes(hf, 3)
    with pytest.raises(RouteShapeError, match="num_hidden_layers"):
        with replay_routes(hf, good[:, :-1]):
            pass
    with pytest.raises(RouteShapeError, match="expert ids must be in"):
        with replay_routes(hf, good + 1000):
            pass
    with pytest.raises(RouteShapeError, match="forward pass routes 4"):
        with replay_routes(hf, good), torch.no_grad():
            hf(torch.tensor([[5, 6, 7, 8]]))
    with pytest.raises(RouteShapeError, match="rows for a sequence of 2"):
        pad_routes(good, 2)
    assert pad_routes(good, 5).shape == (5, cfg.num_hidden_layers, cfg.num_experts_per_tok)
    with torch.no_grad(), replay_routes(hf, good):
        hf(ids)


def test_server_routes_make_transformers_pick_the_servers_experts(tmp_path):
    hf = seeded_wide_model(moe_config("qwen3_moe")).eval()
    hf.save_pretrained(tmp_path)
    prompt = [5, 17, 3, 99, 64, 12, 7, 80, 41, 120, 33]
    with LLM(str(tmp_path), device="cpu", dtype="float32", skip_tokenizer_init=True, max_model_len=128,
             enable_return_routed_experts=True) as llm:
        out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=12, temperature=1.0, seed=0),
                           use_tqdm=False)[0].outputs[0]
    tokens = prompt + list(out.token_ids)
    routes = pad_routes(out.routed_experts, len(tokens))
    seen, handles = experts_seen(hf)
    try:
        with torch.no_grad(), replay_routes(hf, routes) as stats:
            hf(torch.tensor([tokens]))
    finally:
        for h in handles:
            h.remove()
    known = np.asarray(out.routed_experts)
    for layer, got in seen.items():
        assert torch.equal(got[:len(known)].long(), torch.as_tensor(known[:, layer]).long()), layer
    assert stats.agreement == 1.0  # float32 on both sides: the trainer agreed on every row already
