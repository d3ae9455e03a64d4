"""Model construction and checkpoint loading: an HF directory, a hub id, or dummy weights."""

from __future__ import annotations

import glob
import json
import logging
import os
from collections.abc import Iterator

import torch

from rlserve.model.base import CausalLM, missing_weights
from rlserve.model.registry import model_class, served_config

logger = logging.getLogger(__name__)


def resolve_model_path(model: str, revision: str | None = None, cache_dir: str | None = None) -> str:
    """A local directory as is; otherwise a hub id, fetched once (needs network), at
    `revision` (default: main) into `cache_dir` (default: the hub's cache)."""
    if os.path.isdir(model):
        return model
    try:
        from huggingface_hub import snapshot_download
    except ImportError as e:  # pragma: no cover
        raise ValueError(f"model: {model!r} is not a directory and huggingface_hub is missing") from e
    try:
        # *.py: a config's or tokenizer's own code, run only with trust_remote_code.
        return snapshot_download(model, revision=revision, cache_dir=cache_dir, allow_patterns=[
            "*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "tokenizer*", "*.py"])
    except Exception as e:
        raise ValueError(f"model: {model!r} is not a local directory and could not be fetched "
                         f"from the hub ({type(e).__name__}: {e})") from e


def load_tokenizer(path: str, trust_remote_code: bool = False):
    """`trust_remote_code`: run the Python code a tokenizer ships (EngineConfig's field)."""
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)


def load_hf_config(path: str, trust_remote_code: bool = False, overrides: dict | None = None):
    """The model's HF config, with `overrides` (EngineConfig.hf_overrides) set on it.
    `trust_remote_code`: run the Python code a config ships (its auto_map); the
    architecture it names must still be one rlserve implements (registry.py)."""
    from transformers import AutoConfig
    hf_config = served_config(AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code))
    for key, value in (overrides or {}).items():
        setattr(hf_config, key, value)
    return hf_config


def resolve_max_model_len(hf_config, requested: int | None) -> int:
    """`requested` if the model's positions allow it; by default all of them."""
    limit = getattr(hf_config, "max_position_embeddings", None) or 2048
    if requested is not None and requested > limit:
        raise ValueError(f"max_model_len: {requested} exceeds the model's "
                         f"max_position_embeddings ({limit})")
    return requested or limit


def eos_token_ids(hf_config, tokenizer, path: str) -> frozenset[int]:
    """The tokens that end a sequence: the config's, the tokenizer's and generation_config.json's."""
    ids: set[int] = set()
    for source in (getattr(hf_config, "eos_token_id", None), getattr(tokenizer, "eos_token_id", None)):
        if isinstance(source, int):
            ids.add(source)
        elif isinstance(source, (list, tuple)):
            ids.update(int(x) for x in source)
    try:  # generation_config.json often lists extra end-of-turn tokens
        from transformers import GenerationConfig
        gen = GenerationConfig.from_pretrained(path)
        eos = gen.eos_token_id
        ids.update([eos] if isinstance(eos, int) else list(eos or []))
    except Exception:
        pass
    return frozenset(ids)


def iterate_checkpoint(path: str) -> Iterator[tuple[str, torch.Tensor]]:
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if files:
        from safetensors import safe_open
        index = os.path.join(path, "model.safetensors.index.json")
        if os.path.exists(index):  # only the shards the index names (skips stray files)
            with open(index) as f:
                names = set(json.load(f)["weight_map"].values())
            files = [f for f in files if os.path.basename(f) in names]
        for file in files:
            with safe_open(file, framework="pt") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)
        return
    bins = sorted(glob.glob(os.path.join(path, "*.bin")))
    if not bins:
        raise ValueError(f"model: no *.safetensors or *.bin weights in {path}")
    for file in bins:
        # weights_only: a checkpoint cannot run code while it loads.
        state = torch.load(file, map_location="cpu", weights_only=True)
        yield from state.items()


@torch.no_grad()
def init_dummy_weights(model: torch.nn.Module, seed: int) -> None:
    """Small uniform random weights, the same for the same seed and device type."""
    gen = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    for _, p in model.named_parameters():
        # Generated in float32 so bf16/fp32 runs of one seed see the same values, rounded.
        buf = torch.empty(p.shape, dtype=torch.float32, device=p.device)
        buf.uniform_(-1e-3, 1e-3, generator=gen)
        p.data.copy_(buf)


def build_model(hf_config, dtype: torch.dtype, device: str, load_format: str, path: str,
                seed: int = 0) -> CausalLM:
    cls = model_class(hf_config)
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = cls(hf_config)
    finally:
        torch.set_default_dtype(old)
    model.eval().requires_grad_(False)
    if load_format == "dummy":
        init_dummy_weights(model, seed)
        return model
    loaded = model.load_weights(iterate_checkpoint(path))
    missing = sorted(missing_weights(model.expected_weights(), loaded))
    if missing:
        raise ValueError(f"checkpoint {path} lacks {len(missing)} weights: {missing[:10]}")
    return model
