"""Architecture name (config.architectures[0]) -> model class."""

from __future__ import annotations

from rlserve.model.base import CausalLM
from rlserve.model.llama import LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM
from rlserve.model.moe_models import MixtralForCausalLM, OlmoeForCausalLM, Qwen2MoeForCausalLM, Qwen3MoeForCausalLM
from rlserve.model.opt import OPTForCausalLM

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
}


# Configs written without `architectures` (e.g. converted from GGUF) still name a model_type.
_BY_MODEL_TYPE = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                  "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM", "opt": "OPTForCausalLM",
                  "qwen3_moe": "Qwen3MoeForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
                  "mixtral": "MixtralForCausalLM", "olmoe": "OlmoeForCausalLM"}


def model_class(config) -> type[CausalLM]:
    archs = list(getattr(config, "architectures", None) or [])
    if not archs and getattr(config, "model_type", None) in _BY_MODEL_TYPE:
        archs = [_BY_MODEL_TYPE[config.model_type]]
    for arch in archs:
        if arch in ARCHITECTURES:
            return ARCHITECTURES[arch]
    name = archs[0] if archs else f"model_type={getattr(config, 'model_type', None)!r}"
    raise ValueError(f"unsupported architecture {name}; supported: {', '.join(sorted(ARCHITECTURES))}")
