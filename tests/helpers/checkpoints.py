"""Small random checkpoints saved with transformers' save_pretrained, and their tokenizer."""

from __future__ import annotations

import torch


def seeded_wide_model(cfg):
    """transformers' model for `cfg`, float32, seed 0, matrices drawn wider than the default
    init (embeddings most) so that greedy choices are rarely near-ties."""
    from transformers import AutoModelForCausalLM
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if p.dim() > 1:
                p.normal_(0, 0.15 if "embed" in name else 0.05)
    return hf


def random_qwen3_checkpoint(path, vocab: int, hidden_size: int, tie_word_embeddings: bool):
    """A small random Qwen3 checkpoint (GQA, q/k norm) at `path`, with a word-level
    tokenizer ("t<id>", eos t0), for the GPU tests; returns its float32 HF model. The
    embedding is drawn wide enough that few greedy choices are bf16 near-ties."""
    from transformers import Qwen3Config
    cfg = Qwen3Config(vocab_size=vocab, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                      num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2, head_dim=64,
                      max_position_embeddings=2048, tie_word_embeddings=tie_word_embeddings,
                      architectures=["Qwen3ForCausalLM"], eos_token_id=0)
    hf = seeded_wide_model(cfg)
    hf.save_pretrained(path)
    save_word_tokenizer(path, vocab)
    return hf


def save_word_tokenizer(path, vocab: int) -> None:
    """A word-level tokenizer for a random checkpoint: "t<id>" is token id, eos t0."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", eos_token="t0").save_pretrained(path)
