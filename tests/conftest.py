"""Shared fixtures: the demo model, and a real `rlserve serve` process on a free port."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from rlserve import envs
from rlserve.server.launcher import ServerProcess
from rlserve.weight_transfer.address import is_loopback

API_KEY = "test-key"
MAX_MODEL_LEN = 1024
SERVER_START_TIMEOUT_S = envs.RLSERVE_TEST_SERVER_TIMEOUT.get()


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


def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int,
              guess: list[int] | None = None) -> tuple[list[int], list[float]]:
    """The oracle: transformers' greedy continuation, end-of-sequence ignored; the chosen
    tokens and their raw logprobs. Runs on the model's device.

    guess: tokens believed to be that continuation (an engine's output). One forward over
    prompt + guess scores them all, and one token at a time resumes only from the first
    token transformers would not choose: the result is transformers' own either way, in a
    fraction of the time when the guess is right (~150 ms a token on two CPU cores)."""
    device = next(model.parameters()).device
    tokens, logprobs = [], []
    with torch.no_grad():
        if guess:
            guess = list(guess[:max_new_tokens])
            logits = model(torch.tensor([prompt_ids + guess], device=device)).logits[0]
            lp = torch.log_softmax(logits[len(prompt_ids) - 1:].float(), -1)
            for i in range(len(guess) + 1):
                tok = int(lp[i].argmax())
                tokens.append(tok)
                logprobs.append(lp[i, tok].item())
                if len(tokens) == max_new_tokens or i == len(guess) or tok != guess[i]:
                    break
        ids, past = torch.tensor([prompt_ids + tokens], device=device), None
        for _ in range(max_new_tokens - len(tokens)):
            out = model(ids, past_key_values=past, use_cache=True)
            past = out.past_key_values
            lp = torch.log_softmax(out.logits[0, -1].float(), -1)
            tok = int(lp.argmax())
            tokens.append(tok)
            logprobs.append(lp[tok].item())
            ids = torch.tensor([[tok]], device=device)
    return tokens, logprobs


def greedy_reference(model, llm, prompts: list[str], max_new_tokens: int) -> list[list[int]]:
    """transformers' greedy continuations of `prompts`, with the offline engine's outputs
    as hf_greedy's guesses (the oracle stays transformers; the engine only saves it time)."""
    from rlserve import SamplingParams
    outs = llm.generate(prompts, SamplingParams(max_tokens=max_new_tokens, temperature=0, ignore_eos=True))
    return [hf_greedy(model, o.prompt_token_ids, max_new_tokens, guess=o.outputs[0].token_ids)[0]
            for o in outs]


def stream_completion(url: str, model: str, prompt: str, max_tokens: int, results: list,
                      progress: list, i: int, at: tuple[int, Callable[[], object]] | None = None) -> None:
    """One streamed greedy completion; `results[i]` = ([(token_ids, weight version) per
    chunk], finish reason, version spans); `progress[i]` counts tokens as they arrive.
    `at` = (n, action): the action runs once n tokens have arrived, before the next chunk is
    read, so it lands while the request still runs however fast the model is."""
    import httpx
    chunks, finish, spans = [], None, None
    body = dict(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True,
                ignore_eos=True, return_token_ids=True, return_weight_versions=True)
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=300) as r:
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            data = json.loads(line[6:])
            for c in data["choices"]:
                chunks.append((c.get("token_ids") or [], data["weight_version"]))
                progress[i] += len(chunks[-1][0])
                if at is not None and progress[i] >= at[0]:
                    at[1]()
                    at = None
                finish = c.get("finish_reason") or finish
                spans = c.get("weight_version_spans") or spans
    results[i] = (chunks, finish, spans)


class RunningServer(ServerProcess):
    """A test's server: the launcher's process, plus the API key the tests send."""

    def __init__(self, model: str, log: Path, *flags: str, api_key: str | None, timeout_s: float,
                 env: dict[str, str] | None = None):
        self.api_key = api_key
        super().__init__(model, *flags, log=log, timeout_s=timeout_s, die_with_parent=True, env=env)

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def stop(self, timeout_s: float = 30.0) -> None:
        super().stop(timeout_s)
        masters = groups_joined(self.log.read_text(errors="replace")) if self.log and self.log.exists() else []
        outside = [m for m in masters if not is_loopback(m.rpartition(":")[0])]
        # Tests talk over loopback only: a trainer's group at a host interface would not.
        assert not outside, f"the server joined weight-transfer groups off loopback: {outside}"


def groups_joined(log: str) -> list[str]:
    """HOST:PORT of every trainer group a server's log says it joined."""
    return re.findall(r"weight-transfer group at (\S+) as rank", log)


def start_server(model: str, log: Path, *extra: str, api_key: str | None = None,
                 timeout_s: float = SERVER_START_TIMEOUT_S, env: dict[str, str] | None = None) -> RunningServer:
    """`rlserve serve` on CPU in float32 (flags in `extra` override), healthy on return.
    `env`: variables added to the server's environment."""
    flags = ["--device", "cpu", "--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN), *extra]
    if api_key:
        flags += ["--api-key", api_key]
    return RunningServer(model, log, *flags, api_key=api_key, timeout_s=timeout_s, env=env)


def start_tiny_server(log: Path, *extra: str, **kw) -> RunningServer:
    """A two-layer dummy model with the demo model's tokenizer, served as "m": it starts in
    seconds, for tests of the server itself rather than of a model's outputs."""
    from rlserve.model.demo_model import demo_model_path
    from rlserve.model.presets import model_dir
    return start_server(model_dir("tiny"), log, "--load-format", "dummy", "--tokenizer",
                        demo_model_path(), "--served-model-name", "m", *extra, **kw)


def stop_server(server: RunningServer) -> None:
    server.stop(timeout_s=20)


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


# A thinking model's chat template, in Qwen3's manner: reasoning of past turns in <think>,
# and with enable_thinking false an empty think block closes the thinking in the prompt.
THINK_TEMPLATE = """\
{%- for message in messages %}<|im_start|>{{ message.role }}
{% if message.role == "assistant" and message.reasoning_content %}<think>
{{ message.reasoning_content }}
</think>

{% endif %}{{ message.content or "" }}<|im_end|>
{% endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and enable_thinking is false %}<think>

</think>

{% endif %}{% endif %}"""

# Every flag of `vllm serve` that rlserve accepts without a model-specific meaning, at once.
VLLM_FLAGS = ("--reasoning-parser", "qwen3", "--enable-prompt-tokens-details",
              "--enable-force-include-usage", "--root-path", "/gateway",
              "--enable-tokenizer-info-endpoint", "--enable-server-load-tracking",
              "--enable-per-request-metrics", "--show-hidden-metrics-for-version", "0.10",
              "--structured-outputs-config.backend", "xgrammar",
              "--watermark-config", '{"watermark_alpha": 0.5}', "--enable-auto-tool-choice",
              "--enable-sleep-mode")


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
