"""The offline LLM as a drop-in for vLLM's: a progress bar, TextPrompt / TokensPrompt dicts,
sleep and wake-up, and weights updated from tensors in the same process (a trainer's).

A two-layer model with the demo model's tokenizer: the engine starts with dummy weights,
then takes a transformers model's tensors, after which its logprobs are transformers'."""

from __future__ import annotations

import json

import pytest
import torch

from rlserve import LLM, SamplingParams
from rlserve.model.demo_model import demo_model_path
from rlserve.model.presets import PRESETS, model_dir

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def llm():
    with LLM(model_dir("tiny"), load_format="dummy", tokenizer=demo_model_path(), device="cpu",
             dtype="float32", max_model_len=256, kv_cache_memory_bytes=32 << 20) as llm:
        yield llm


@pytest.fixture(scope="module")
def trainer_model():
    """The trainer's model: transformers, same architecture, its own random weights."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    config = LlamaConfig(**{k: v for k, v in PRESETS["tiny"].items() if k != "architectures"})
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # larger than the default init, so the logits are far from ties
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.08)
    return model


def _prompt_logprobs(llm: LLM, ids: list[int]) -> list[float]:
    out = llm.generate([ids], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
    return [lp.logprob for lp in out.prompt_logprobs[1:]]


def _reference(model, ids: list[int]) -> list[float]:
    with torch.no_grad():
        logprobs = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
    return [logprobs[i - 1, ids[i]].item() for i in range(1, len(ids))]


def test_progress_bar(llm, capsys):
    llm.generate([PROMPT] * 3, SamplingParams(max_tokens=2))
    err = capsys.readouterr().err
    assert "Processed prompts" in err and "3/3" in err and "output:" in err
    llm.generate([PROMPT], SamplingParams(max_tokens=2), use_tqdm=False)
    assert "Processed prompts" not in capsys.readouterr().err


def test_dict_prompts_as_vllm_takes_them(llm):
    greedy = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    ids = llm.get_tokenizer().encode(PROMPT)
    outs = llm.generate([PROMPT, ids, {"prompt": PROMPT}, {"prompt_token_ids": ids, "cache_salt": "s"}],
                        greedy, use_tqdm=False)
    assert len({tuple(o.outputs[0].token_ids) for o in outs}) == 1
    assert [o.prompt for o in outs] == [PROMPT, None, PROMPT, None]
    assert all(o.prompt_token_ids == ids for o in outs)
    single = llm.generate({"prompt_token_ids": ids}, greedy, use_tqdm=False)
    assert single[0].outputs[0].token_ids == outs[0].outputs[0].token_ids
    for bad in ({"prompt": PROMPT, "prompt_token_ids": ids}, {"prompt_embeds": [0.0]}, {}):
        with pytest.raises(ValueError, match="prompt_token_ids"):
            llm.generate([bad], greedy, use_tqdm=False)


def test_update_weights_from_tensors_sleep_and_wake(llm, trainer_model):
    ids = llm.get_tokenizer().encode(PROMPT + " Paris, and the capital of Italy is")
    ref = _reference(trainer_model, ids)
    assert max(abs(a - b) for a, b in zip(_prompt_logprobs(llm, ids), ref)) > 1e-2  # dummy weights

    version = llm.update_weights(trainer_model.named_parameters())
    assert version == llm.engine.weight_version
    assert max(abs(a - b) for a, b in zip(_prompt_logprobs(llm, ids), ref)) < 1e-4

    llm.sleep(level=1)  # weights to host memory and back
    assert llm.is_sleeping()
    with pytest.raises(RuntimeError, match="wake_up"):
        llm.update_weights(trainer_model.named_parameters())
    llm.wake_up()
    assert not llm.is_sleeping()
    assert max(abs(a - b) for a, b in zip(_prompt_logprobs(llm, ids), ref)) < 1e-4

    llm.sleep(level=2)  # weights dropped: generation waits for a whole update
    llm.wake_up()
    with pytest.raises(Exception, match="update"):
        _prompt_logprobs(llm, ids)
    partial = [(n, p) for n, p in trainer_model.named_parameters() if "layers.0." not in n]
    with pytest.raises(ValueError, match="every weight must be sent"):
        llm.update_weights(partial)
    llm.update_weights(trainer_model.named_parameters(), weight_version=42)
    assert llm.engine.weight_version == 42
    assert max(abs(a - b) for a, b in zip(_prompt_logprobs(llm, ids), ref)) < 1e-4
    # vLLM's RL order: wake the weights, update them, then the KV cache.
    llm.sleep(level=2)
    llm.wake_up(tags=["weights"])
    assert llm.is_sleeping()
    llm.update_weights(trainer_model.named_parameters(), weight_version=43)
    llm.wake_up(tags=["kv_cache"])
    assert not llm.is_sleeping()
    assert max(abs(a - b) for a, b in zip(_prompt_logprobs(llm, ids), ref)) < 1e-4


def test_trust_remote_code_runs_the_config_code_a_model_ships(tmp_path):
    """A model whose config.json names its own config class (auto_map) is refused without
    trust_remote_code, naming it, and loads and generates with it."""
    config = dict(PRESETS["tiny"], model_type="tiny_remote",
                  auto_map={"AutoConfig": "configuration_tiny.TinyConfig"})
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "configuration_tiny.py").write_text(
        "from transformers import LlamaConfig\n\n\nclass TinyConfig(LlamaConfig):\n"
        "    model_type = 'tiny_remote'\n")
    options = dict(load_format="dummy", skip_tokenizer_init=True, device="cpu", dtype="float32",
                   max_model_len=64, kv_cache_memory_bytes=8 << 20)
    with pytest.raises(ValueError, match="trust_remote_code"):
        LLM(str(tmp_path), **options)
    with LLM(str(tmp_path), trust_remote_code=True, **options) as llm:
        assert type(llm.engine.hf_config).__name__ == "TinyConfig"
        out = llm.generate([{"prompt_token_ids": [1, 2, 3]}],
                           SamplingParams(max_tokens=2, temperature=0, detokenize=False), use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 2


def test_shutdown_frees_the_model_for_the_next_llm():
    """After shutdown() the engine's weights are gone even while the LLM object lives (on a GPU
    that is what lets a second LLM in the process size its cache from the whole device), and
    using it again says it was shut down."""
    import gc
    import weakref
    llm = LLM(model_dir("tiny"), load_format="dummy", tokenizer=demo_model_path(), device="cpu",
              dtype="float32", max_model_len=256, kv_cache_memory_bytes=8 << 20)
    weight = weakref.ref(next(llm.engine.executor.local_runner.model.parameters()))
    assert llm.generate(PROMPT, SamplingParams(max_tokens=2))[0].outputs[0].token_ids
    llm.shutdown()
    gc.collect()
    assert weight() is None
    with pytest.raises(RuntimeError, match="shut down"):
        llm.generate(PROMPT, SamplingParams(max_tokens=2))
    llm.shutdown()  # a second shutdown is a no-op, as with `with LLM(...)` after a shutdown
