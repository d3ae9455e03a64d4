"""The offline API, in the shape users know from vLLM:

    from rlserve import LLM, SamplingParams
    llm = LLM("path/or/hub-id", device="cpu", dtype="float32")
    outs = llm.generate(["Hello"], SamplingParams(max_tokens=32, temperature=0))
"""

from __future__ import annotations

import itertools
import time
from typing import Sequence

from rlserve.config import EngineConfig
from rlserve.engine.bad_words import convert_bad_words
from rlserve.engine.core import EngineCore
from rlserve.engine.output_processor import OutputProcessor, RequestState
from rlserve.engine.request import RequestOutput, SamplingParams, check_cache_salt


class LLM:
    def __init__(self, model: str | None = None, **kwargs):
        if model is None:
            from rlserve.model.demo_model import demo_model_path
            model = demo_model_path()
        self.engine = EngineCore(EngineConfig(model=model, **kwargs))
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()
        # generate() returns whole results: the engine reports a request once, when it
        # finishes, unless its stop strings need the text as it grows (tests set this to
        # compare with the per-step path the server streams).
        self._report_every_step = False

    def get_tokenizer(self):
        return self.tokenizer

    def generate(self, prompts: str | Sequence[str] | Sequence[int] | Sequence[Sequence[int]],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 cache_salt: str | None = None, lora_request=None) -> list[RequestOutput]:
        """Generate for every prompt (strings or token-id lists), returned in input order.

        `cache_salt`: these prompts share prefix-cache blocks only with requests of the same salt.
        `lora_request`: the LoRA adapter to run with, for all prompts or one per prompt
        (None: the base model): a LoRARequest(name, id, path) as in vLLM (loaded from
        `path` on first use) or a loaded adapter's name.
        """
        check_cache_salt(cache_salt)
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params or SamplingParams()
        params_list = list(params) if isinstance(params, Sequence) else [params] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError("sampling_params: one per prompt, or a single one for all")
        lora_names = self._lora_names(lora_request, len(prompts))

        processor = OutputProcessor(self.tokenizer)
        # Validate everything before admitting anything, so a bad prompt leaves no work behind.
        pending = []
        converted: dict[int, SamplingParams] = {}  # bad_words as token ids, once per params object
        for prompt, p in zip(prompts, params_list):
            if id(p) not in converted:
                converted[id(p)] = convert_bad_words(p, self.tokenizer)
            p = converted[id(p)]
            text = prompt if isinstance(prompt, str) else None
            ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
            rid = str(next(self._ids))
            stream = self._report_every_step or processor.needs_steps(p)
            pending.append((RequestState(rid, text, ids, p),
                            self.engine.make_requests(ids, p, rid, stream, cache_salt, lora_names[len(pending)])))
        for state, reqs in pending:
            processor.add(state)
            for req in reqs:
                self.engine.add_request(req)

        engine = self.engine
        while engine.has_unfinished():
            out = engine.step()
            if out is None and not engine.has_work():
                time.sleep(0.001)  # only grammars still compiling
            if out is not None:
                aborts = processor.process(out)
                if aborts:  # stop strings: the samples ended here
                    engine.abort(aborts)
        return [state.output() for state, _ in pending]

    def chat(self, messages, sampling_params: SamplingParams | None = None,
             chat_template: str | None = None) -> list[RequestOutput]:
        """One conversation (a list of {"role", "content"}) or a list of them."""
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [self.apply_chat_template(c, chat_template) for c in convs]
        return self.generate(prompts, sampling_params)

    def apply_chat_template(self, messages, chat_template: str | None = None) -> list[int]:
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                 tokenize=True, chat_template=chat_template)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # BatchEncoding in newer versions
            ids = ids["input_ids"]
        return list(ids)

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

    def shutdown(self) -> None:
        """Stop tensor-parallel workers and release the engine (also on `with LLM(...)` exit)."""
        self.engine.shutdown()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()
