"""Shared fixtures: the demo model, transformers on it, and one real `rlserve serve`
process for the session. What tests import (servers, oracles, checkpoints) is tests/helpers."""

from __future__ import annotations

import os
from collections.abc import Iterator

# Read by torch at import and inherited by every process the tests start: servers,
# tensor-parallel workers and data-parallel replicas run beside the test process, and on a
# small machine each spinning a thread per core makes all of them slower. A caller's value stands.
if (os.cpu_count() or 1) <= 4:
    os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from helpers.reasoning import THINK_TEMPLATE, VLLM_FLAGS
from helpers.servers import API_KEY, MAX_MODEL_LEN, RunningServer, start_server, stop_server, wait_for_stopped


@pytest.fixture(scope="session", autouse=True)
def servers_exited() -> Iterator[None]:
    """The last teardown: every server that stop_server left exiting has exited."""
    yield
    wait_for_stopped()


@pytest.fixture(scope="session")
def demo_model() -> str:
    from rlserve.model.demo_model import demo_model_path
    return demo_model_path()


@pytest.fixture(scope="session")
def hf_demo(demo_model: str):
    """transformers' own model on the demo weights, float32: the reference outputs come
    from it. Shared by every module, so no test may change its weights in place."""
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(demo_model, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def server(demo_model: str, tmp_path_factory: pytest.TempPathFactory,
           ) -> Iterator[RunningServer]:
    """One server for the whole session, with an API key (so 401s are testable too)."""
    log = tmp_path_factory.mktemp("server") / "server.log"
    srv = start_server(demo_model, log, api_key=API_KEY)
    yield srv
    stop_server(srv)


@pytest.fixture(scope="session")
def client(server: RunningServer):
    from openai import OpenAI
    return OpenAI(base_url=f"{server.url}/v1", api_key=server.api_key or "EMPTY",
                  max_retries=0, timeout=300)


@pytest.fixture(scope="session")
def offline_llm(demo_model: str):
    """The offline API on the same model: the reference the server must match."""
    from rlserve import LLM
    return LLM(demo_model, device="cpu", dtype="float32", max_model_len=MAX_MODEL_LEN)


@pytest.fixture(scope="session")
def think_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A two-layer random Qwen3 with the demo model's tokenizer, <think> and </think> added
    as words (as Qwen3's vocabulary has them), and THINK_TEMPLATE."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen3Config

    from rlserve.model.demo_model import demo_model_path
    path = tmp_path_factory.mktemp("qwen3-think")
    tok = AutoTokenizer.from_pretrained(demo_model_path())
    tok.add_tokens(["<think>", "</think>"])
    tok.chat_template = THINK_TEMPLATE
    tok.save_pretrained(path)
    cfg = Qwen3Config(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                      max_position_embeddings=1024, tie_word_embeddings=True,
                      architectures=["Qwen3ForCausalLM"], eos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def flags_server(think_model: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    """think_model served as "q" with VLLM_FLAGS (the reasoning parser among them): one
    server for the tests of vLLM's flags, reasoning and request fields."""
    srv = start_server(think_model, tmp_path_factory.mktemp("flags") / "server.log",
                       "--served-model-name", "q", *VLLM_FLAGS)
    yield srv
    stop_server(srv)
