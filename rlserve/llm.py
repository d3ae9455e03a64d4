"""The offline API, in the shape users know from vLLM:

    from rlserve import LLM, SamplingParams
    llm = LLM("path/or/hub-id", device="cpu", dtype="float32")
    outs = llm.generate(["Hello"], SamplingParams(max_tokens=32, temperature=0))
"""

from __future__ import annotations

import gc
import itertools
import time
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from rlserve.config import EngineConfig
from rlserve.engine.core import EngineCore
from rlserve.engine.request import Request
from rlserve.frontend.bad_words import convert_bad_words
from rlserve.frontend.output_processor import OutputProcessor, RequestState
from rlserve.frontend.request_output import RequestOutput
from rlserve.model.base import missing_weights
from rlserve.sampling_params import SamplingParams
from rlserve.wire.outputs import EngineCoreOutputs
from rlserve.wire.validation import check_cache_salt

if TYPE_CHECKING:
    import torch

# A string, token ids, or vLLM's {"prompt": ...} / {"prompt_token_ids": [...]}.
PromptInput = str | Sequence[int] | dict


class _Progress:
    """tqdm over the prompts of one generate call, with vLLM's speed estimate."""

    def __init__(self, total: int, enabled: bool):
        self.bar = None
        self.start = time.perf_counter()
        self.tokens_in = self.tokens_out = 0
        self.done: set[int] = set()  # prompts counted (all their samples finished)
        if enabled and total:
            from tqdm.auto import tqdm
            self.bar = tqdm(total=total, desc="Processed prompts", dynamic_ncols=True,
                            postfix="est. speed input: 0.00 toks/s, output: 0.00 toks/s")

    def sample_done(self, state: RequestState | None) -> None:
        if self.bar is None or state is None or not state.finished or id(state) in self.done:
            return
        self.done.add(id(state))
        self.tokens_in += len(state.prompt_token_ids)
        self.tokens_out += sum(len(s.token_ids) for s in state.samples)
        elapsed = max(time.perf_counter() - self.start, 1e-9)
        self.bar.postfix = (f"est. speed input: {self.tokens_in / elapsed:.2f} toks/s, "
                            f"output: {self.tokens_out / elapsed:.2f} toks/s")
        self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


class LLM:
    def __init__(self, model: str | None = None, **kwargs):
        if model is None:
            from rlserve.model.demo_model import demo_model_path
            model = demo_model_path()
        config = EngineConfig(model=model, **kwargs)
        self.reasoning_parser = config.reasoning_parser
        self.engine = EngineCore(config)
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()
        # generate() returns whole results: the engine reports a request once, when it
        # finishes, unless its stop strings need the text as it grows (tests set this to
        # compare with the per-step path the server streams).
        self._report_every_step = False

    def get_tokenizer(self):
        return self.tokenizer

    def generate(self, prompts: PromptInput | Sequence[PromptInput],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True, cache_salt: str | None = None, lora_request=None
                 ) -> list[RequestOutput]:
        """Generate for every prompt, returned in input order. A prompt is a string, a list
        of token ids, or (as vLLM's TextPrompt / TokensPrompt) {"prompt": str} or
        {"prompt_token_ids": [...]}, either with an optional "cache_salt".

        `use_tqdm`: a progress bar of finished prompts. `cache_salt`: these prompts share
        prefix-cache blocks only with requests of the same salt.
        `lora_request`: the LoRA adapter to run with, for all prompts or one per prompt
        (None: the base model): a LoRARequest(name, id, path) as in vLLM (loaded from
        `path` on first use) or a loaded adapter's name.
        """
        check_cache_salt(cache_salt)
        if isinstance(prompts, (str, dict)) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[assignment]  # one prompt: a batch of it
        params = sampling_params or SamplingParams()
        params_list = list(params) if isinstance(params, Sequence) else [params] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError("sampling_params: one per prompt, or a single one for all")
        lora_names = self._lora_names(lora_request, len(prompts))

        processor = OutputProcessor(self.tokenizer)
        processor.routes_expected = self.engine.kv.routes is not None
        # Validate everything before admitting anything, so a bad prompt leaves no work behind.
        pending: list[tuple[RequestState, list[Request]]] = []
        converted: dict[int, SamplingParams] = {}  # bad_words as token ids, once per params object
        for i, (prompt, p) in enumerate(zip(prompts, params_list)):
            if id(p) not in converted:
                converted[id(p)] = convert_bad_words(p, self.tokenizer)
            p = converted[id(p)]
            text, ids, salt = self._prompt(prompt, i, cache_salt)
            rid = str(next(self._ids))
            stream = self._report_every_step or processor.needs_steps(p)
            pending.append((RequestState(rid, text, ids, p),
                            self.engine.make_requests(ids, p, rid, stream, salt, lora_names[len(pending)])))
        owners = {}
        for state, reqs in pending:
            processor.add(state)
            for req in reqs:
                self.engine.add_request(req)
                owners[req.request_id] = state

        progress = _Progress(len(pending), use_tqdm)
        engine = self.engine
        try:
            while engine.has_unfinished():
                out = engine.step()
                if out is None and not engine.has_work():
                    time.sleep(0.001)  # only grammars still compiling
                if out is not None:
                    aborts = processor.process(out)
                    if aborts:  # stop strings: the samples ended here; the aborts bring their routes
                        processor.process(EngineCoreOutputs(engine.weight_version, finished=engine.abort(aborts)))
                    for rid in [f.request_id for f in out.finished] + aborts:
                        progress.sample_done(owners.pop(rid, None))
        finally:
            progress.close()
        return [state.output() for state, _ in pending]

    def _prompt(self, prompt: PromptInput, index: int,
                cache_salt: str | None) -> tuple[str | None, list[int], str | None]:
        """(text, token ids, cache salt) of one prompt."""
        if isinstance(prompt, str):
            return prompt, self._text_tokenizer().encode(prompt), cache_salt
        if isinstance(prompt, dict):
            unknown = set(prompt) - {"prompt", "prompt_token_ids", "cache_salt"}
            if unknown or ("prompt" in prompt) == ("prompt_token_ids" in prompt):
                raise ValueError(
                    f"prompts[{index}]: a dict prompt holds 'prompt' (text) or 'prompt_token_ids', "
                    f"and optionally 'cache_salt'; got keys {sorted(prompt)}")
            salt = prompt.get("cache_salt", cache_salt)
            check_cache_salt(salt)
            if "prompt" in prompt:
                if not isinstance(prompt["prompt"], str):
                    raise TypeError(f"prompts[{index}]['prompt']: must be a string")
                return prompt["prompt"], self._text_tokenizer().encode(prompt["prompt"]), salt
            return None, list(prompt["prompt_token_ids"]), salt
        if isinstance(prompt, Sequence) and all(isinstance(t, int) for t in prompt):
            # (mypy 2.4 adds str back to prompt's type at this isinstance: it cannot be one here.)
            return None, list(prompt), cache_salt  # type: ignore[arg-type]
        raise TypeError(f"prompts[{index}]: expected a string, a list of token ids or a dict "
                        f"prompt, got {type(prompt).__name__}")

    def chat(self, messages, sampling_params: SamplingParams | None = None, use_tqdm: bool = True,
             chat_template: str | None = None,
             chat_template_kwargs: dict[str, Any] | None = None) -> list[RequestOutput]:
        """One conversation (a list of {"role", "content"}) or a list of them. With a
        `reasoning_parser`, each output's `reasoning` and `content` hold its text split
        into the thinking and the answer (`text` stays the whole text of `token_ids`)."""
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [self.apply_chat_template(c, chat_template, chat_template_kwargs) for c in convs]
        outs = self.generate(prompts, sampling_params, use_tqdm)
        if self.reasoning_parser is not None:
            self._split_reasoning(outs, sampling_params, chat_template_kwargs)
        return outs

    def _split_reasoning(self, outs: list[RequestOutput], sampling_params: SamplingParams | None,
                         chat_template_kwargs: dict[str, Any] | None) -> None:
        from rlserve.frontend.reasoning_parsers import REASONING_PARSERS
        parser = REASONING_PARSERS[self.reasoning_parser]  # type: ignore[index]
        constrained = sampling_params is not None and sampling_params.structured_outputs is not None
        for out in outs:
            # The prompt's end says whether the template already closed the thinking.
            tail = self._text_tokenizer().decode(out.prompt_token_ids[-8:], skip_special_tokens=False)
            for sample in out.outputs:
                sample.reasoning, sample.content = parser.split(tail, chat_template_kwargs, constrained,
                                                                sample.text)

    def apply_chat_template(self, messages, chat_template: str | None = None,
                            chat_template_kwargs: dict[str, Any] | None = None) -> list[int]:
        ids = self._text_tokenizer().apply_chat_template(messages, add_generation_prompt=True,
                                                         tokenize=True, chat_template=chat_template,
                                                         **(chat_template_kwargs or {}))
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # BatchEncoding in newer versions
            ids = ids["input_ids"]
        return list(ids)

    def _text_tokenizer(self):
        """The tokenizer, which text prompts and chat messages need."""
        if self.tokenizer is None:
            raise ValueError("text prompts and chat messages need the tokenizer, which this LLM was "
                             "started without (skip_tokenizer_init): pass token ids")
        return self.tokenizer

    def _lora_names(self, lora_request, num_prompts: int) -> list[str | None]:
        from rlserve.engine.lora import LoRARequest
        many = isinstance(lora_request, (list, tuple)) and not isinstance(lora_request, LoRARequest)
        requests = list(lora_request) if many else [lora_request] * num_prompts
        if len(requests) != num_prompts:
            raise ValueError("lora_request: one per prompt, or a single one for all")
        names = []
        for r in requests:
            if isinstance(r, LoRARequest):
                if r.lora_path is not None and r.lora_name not in {a["name"] for a in self.list_lora_adapters()}:
                    self.load_lora_adapter(r.lora_name, r.lora_path)
                r = r.lora_name
            names.append(r)
        return names

    def load_lora_adapter(self, name: str, path: str, load_inplace: bool = False) -> dict:
        """Load a PEFT adapter directory (adapter_config.json + adapter_model.safetensors)."""
        return self.engine.load_lora_adapter(name, path, load_inplace)

    def unload_lora_adapter(self, name: str) -> None:
        self.engine.unload_lora_adapter(name)

    def list_lora_adapters(self) -> list[dict]:
        return self.engine.list_lora_adapters()

    def reset_prefix_cache(self) -> None:
        self.engine.reset_prefix_cache()

    # -- between rollouts: memory and weights ------------------------------------------------
    def sleep(self, level: int = 1) -> None:
        """Give the device memory back: the KV cache and CUDA graphs always; the weights go
        to host memory (level 1) or are dropped (level 2: the next `update_weights`, after
        `wake_up`, must send every weight). `generate` waits for nothing: call `wake_up`."""
        self.engine.sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Undo `sleep`: everything, or what `tags` names ("weights", "kv_cache": vLLM's
        partial wake-up, to update the weights before the KV cache takes its memory back).
        `is_sleeping()` stays true until everything is awake."""
        self.engine.wake_up(tags)

    def is_sleeping(self) -> bool:
        return self.engine.state.sleeping

    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]],
                       weight_version: int | None = None) -> int:
        """Copy (HF name, tensor) pairs into the model, in place, from this process (e.g. a
        trainer's `model.named_parameters()`); returns the new weight version. Names and
        shapes are checked as each tensor is copied. After `sleep(level=2)` the update must
        hold every weight, and is refused (before anything is copied) otherwise."""
        if self.engine.state.weights_asleep:
            raise RuntimeError("update_weights: the weights are asleep; call wake_up() (or "
                               "wake_up(tags=['weights'])) first")
        weights = list(weights)
        state = self.engine.state
        if state.no_weights:  # dropped by sleep(level=2): a partial update would leave garbage
            missing = sorted(missing_weights(self.engine.executor.expected_weights, (n for n, _ in weights)))
            if missing:
                raise ValueError(f"update_weights: the weights were dropped by sleep(level=2), so every "
                                 f"weight must be sent; missing {missing[:5]}"
                                 f"{' ...' if len(missing) > 5 else ''} ({len(missing)} in all)")
        version = self.engine.apply_weights(weights, weight_version)
        state.no_weights = False
        return version

    def shutdown(self) -> None:
        """Stop tensor-parallel workers and release the engine (also on `with LLM(...)` exit):
        its weights, KV cache and CUDA graphs are freed and the allocator's cache given back,
        so a second LLM in the same process (the next experiment, a trainer's next stage) can
        size its cache from the whole device again. Any later use says it was shut down."""
        engine = self.engine
        if isinstance(engine, _ShutDown):
            return
        engine.shutdown()
        device = engine.device
        self.engine = _ShutDown()  # type: ignore[assignment]
        del engine
        gc.collect()  # the engine's reference cycles hold the model
        if device.type == "cuda":
            import torch
            torch.cuda.empty_cache()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()


class _ShutDown:
    """Where a shut-down LLM's engine was."""

    def __getattr__(self, name: str):
        raise RuntimeError(f"this LLM was shut down (engine.{name}); start a new LLM to generate again")
