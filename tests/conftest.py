"""Shared fixtures: the demo model, transformers on it, and one real `rlserve serve`
process for the session. What tests import (servers, oracles, checkpoints) is tests/helpers."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from helpers.servers import API_KEY, MAX_MODEL_LEN, RunningServer, start_server, stop_server


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
