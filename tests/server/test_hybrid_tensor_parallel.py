"""Hybrid models split over two ranks on CPU (gloo): Qwen3.5 and Qwen3-Next at
tensor_parallel_size 2 give the tokens of one rank and of transformers, with each rank
holding half of the linear-attention heads (their projections, conv channels and states)
and half of the attention heads; a prefix-cache hit's state copies reach both ranks. The
two ranks run with overlapped scheduling (rank 1 reads rank 0's tokens on the device)."""

from __future__ import annotations

import pytest

from helpers.hybrid import hybrid_model, prompts
from helpers.oracle import hf_greedy
from rlserve import LLM, SamplingParams

MAX_TOKENS = 16
PARAMS = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, logprobs=0)


def generate(path: str, tp: int, ids: list[list[int]]):
    """Greedy tokens and logprobs of `ids` batched, then of the last prompt again (a
    prefix-cache hit); what the driver rank's first linear-attention layer holds."""
    llm = LLM(path, device="cpu", dtype="float32", skip_tokenizer_init=True, max_model_len=512,
              max_num_batched_tokens=64, tensor_parallel_size=tp, async_scheduling=tp > 1)
    try:
        assert llm.engine.world_size == tp
        layer = llm.engine.executor.local_runner.model.model.layers[0].linear_attn
        held = (layer.shape.num_k_heads, layer.shape.num_v_heads, layer.conv1d.weight.shape[0],
                tuple(layer.recurrent_state.shape[1:]))
        outs = llm.generate([{"prompt_token_ids": p} for p in ids], PARAMS, use_tqdm=False)
        (again,) = llm.generate([{"prompt_token_ids": ids[-1]}], PARAMS, use_tqdm=False)
        return [_tokens(o) for o in outs], again, held
    finally:
        llm.engine.shutdown()


def _tokens(out) -> tuple[list[int], list[float]]:
    return out.outputs[0].token_ids, [x.logprob for x in out.outputs[0].logprobs]


@pytest.mark.parametrize("arch", ["qwen3_5", "qwen3_next"])
def test_tp2_gives_the_tokens_of_tp1_and_of_transformers(arch, tmp_path):
    hf = hybrid_model(arch)
    hf.save_pretrained(tmp_path)
    ids = prompts(4)
    one, _, whole = generate(str(tmp_path), 1, ids)
    two, hit, half = generate(str(tmp_path), 2, ids)
    # 2 key heads, 4 value heads, conv channels 2 x 2 x 16 + 4 x 8: each rank holds half.
    assert whole == (2, 4, 96, (4, 16, 8)) and half == (1, 2, 48, (2, 16, 8))
    assert hit.num_cached_tokens == 144
    assert _tokens(hit)[0] == two[-1][0]
    assert max(abs(a - b) for a, b in zip(_tokens(hit)[1], two[-1][1])) < 1e-4
    for prompt, (tokens, logprobs), (want, want_logprobs) in zip(ids, two, one):
        assert tokens == want, arch
        assert max(abs(a - b) for a, b in zip(logprobs, want_logprobs)) < 1e-4, arch
        hf_tokens, _ = hf_greedy(hf, prompt, MAX_TOKENS, guess=tokens)
        assert tokens == hf_tokens, arch
