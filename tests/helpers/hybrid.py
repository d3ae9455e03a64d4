"""Small random hybrid models (Qwen3.5, its multimodal checkpoint, Qwen3.5-MoE, Qwen3-Next)
as transformers builds them, prompts for them, and the text model's weight names."""

from __future__ import annotations

import torch

VOCAB = 128
COMMON = dict(vocab_size=VOCAB, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=8,
              linear_conv_kernel_dim=4, max_position_embeddings=512, num_hidden_layers=4, eos_token_id=0,
              bos_token_id=1)
MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48)


def hybrid_model(arch: str):
    """transformers' model for `arch`, float32, seed 0, every parameter drawn (the norms'
    and the decay's too, so that none sits at its neutral initial value)."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5ForConditionalGeneration, Qwen3NextForCausalLM
    from transformers.models.qwen3_5 import Qwen3_5Config, Qwen3_5TextConfig
    from transformers.models.qwen3_5_moe import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig
    from transformers.models.qwen3_next import Qwen3NextConfig
    torch.manual_seed(0)
    if arch == "qwen3_5":
        hf = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**COMMON, intermediate_size=96,
                                                  architectures=["Qwen3_5ForCausalLM"]))
    elif arch == "qwen3_5_vl":
        vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=4,
                      num_position_embeddings=16)
        hf = Qwen3_5ForConditionalGeneration(Qwen3_5Config(
            text_config=dict(**COMMON, intermediate_size=96), vision_config=vision,
            architectures=["Qwen3_5ForConditionalGeneration"]))
    elif arch == "qwen3_5_moe":
        hf = Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(**COMMON, **MOE, architectures=["Qwen3_5MoeForCausalLM"]))
    else:
        hf = Qwen3NextForCausalLM(Qwen3NextConfig(**COMMON, **MOE, intermediate_size=96, mlp_only_layers=[1],
                                                  norm_topk_prob=True, architectures=["Qwen3NextForCausalLM"]))
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "A_log" in name or "dt_bias" in name:
                p.uniform_(-1, 1)
            else:
                p.normal_(0, 0.15 if "embed" in name else 0.1 if p.dim() == 1 else 0.05)
    return hf.float().eval()


def prompts(n: int = 8) -> list[list[int]]:
    """n prompts of 3 to 40 tokens, and the last of 150: more than one prefill chunk (64)."""
    g = torch.Generator().manual_seed(0)
    out = [torch.randint(2, VOCAB, (int(length),), generator=g).tolist()
           for length in torch.randint(3, 40, (n,), generator=g)]
    out[-1] = torch.randint(2, VOCAB, (150,), generator=g).tolist()
    return out


def text_names(named: list) -> list:
    """The text model's tensors under the text model's spelling (`model.layers...`)."""
    out = []
    for name, t in named:
        if name.startswith("model.visual."):
            continue
        out.append((name.replace("model.language_model.", "model.", 1), t))
    return out
