"""Architecture name (config.architectures[0]) -> model class."""

from __future__ import annotations

from rlserve.model.base import CausalLM
from rlserve.model.llama import LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM
from rlserve.model.moe_models import MixtralForCausalLM, OlmoeForCausalLM, Qwen2MoeForCausalLM, Qwen3MoeForCausalLM
from rlserve.model.opt import OPTForCausalLM
from rlserve.model.qwen3_next import (
    Qwen3_5ForCausalLM,
    Qwen3_5ForConditionalGeneration,
    Qwen3_5MoeForCausalLM,
    Qwen3_5MoeForConditionalGeneration,
    Qwen3NextForCausalLM,
)

ARCHITECTURES: dict[str, type[CausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "OPTForCausalLM": OPTForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "Qwen2MoeForCausalLM": Qwen2MoeForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "OlmoeForCausalLM": OlmoeForCausalLM,
    "Qwen3NextForCausalLM": Qwen3NextForCausalLM,
    "Qwen3_5ForCausalLM": Qwen3_5ForCausalLM,
    "Qwen3_5ForConditionalGeneration": Qwen3_5ForConditionalGeneration,
    "Qwen3_5MoeForCausalLM": Qwen3_5MoeForCausalLM,
    "Qwen3_5MoeForConditionalGeneration": Qwen3_5MoeForConditionalGeneration,
}

# Multimodal wrappers of which only the text model is served: their config's text_config.
_TEXT_ONLY = ("Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForConditionalGeneration")


# Configs written without `architectures` (e.g. converted from GGUF) still name a model_type.
_BY_MODEL_TYPE = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                  "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM", "opt": "OPTForCausalLM",
                  "qwen3_moe": "Qwen3MoeForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
                  "mixtral": "MixtralForCausalLM", "olmoe": "OlmoeForCausalLM",
                  "qwen3_next": "Qwen3NextForCausalLM", "qwen3_5_text": "Qwen3_5ForCausalLM",
                  "qwen3_5": "Qwen3_5ForConditionalGeneration", "qwen3_5_moe_text": "Qwen3_5MoeForCausalLM",
                  "qwen3_5_moe": "Qwen3_5MoeForConditionalGeneration"}


def served_config(config):
    """The config the served model reads: a multimodal wrapper's text_config (its vocabulary,
    positions and layers), keeping the wrapper's architecture, which says how its weights
    are named; any other config as it is."""
    archs = list(getattr(config, "architectures", None) or [])
    if not archs and getattr(config, "model_type", None) in _BY_MODEL_TYPE:
        archs = [_BY_MODEL_TYPE[config.model_type]]
    if not archs or archs[0] not in _TEXT_ONLY or getattr(config, "text_config", None) is None:
        return config
    text = config.get_text_config()
    text.architectures = archs
    # The wrapper's own flag ties its head (transformers ignores the text_config's).
    text.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
    for key in ("eos_token_id", "bos_token_id"):
        if getattr(text, key, None) is None and getattr(config, key, None) is not None:
            setattr(text, key, getattr(config, key))
    return text


def model_class(config) -> type[CausalLM]:
    archs = list(getattr(config, "architectures", None) or [])
    if not archs and getattr(config, "model_type", None) in _BY_MODEL_TYPE:
        archs = [_BY_MODEL_TYPE[config.model_type]]
    for arch in archs:
        if arch in ARCHITECTURES:
            return ARCHITECTURES[arch]
    name = archs[0] if archs else f"model_type={getattr(config, 'model_type', None)!r}"
    raise ValueError(f"unsupported architecture {name}; supported: {', '.join(sorted(ARCHITECTURES))}")
