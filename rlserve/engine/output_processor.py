"""Accumulates engine deltas into the RequestOutput users see (one per prompt, n samples)."""

from __future__ import annotations

from rlserve.engine.request import CompletionOutput, EngineOutput, RequestOutput, TokenLogprob


class RequestState:
    """Everything produced so far for one prompt and its n samples."""

    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                 n: int, want_logprobs: bool):
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.prompt_logprobs: list[TokenLogprob | None] | None = None
        self.outputs = [CompletionOutput(i, "", [], [] if want_logprobs else None, None)
                        for i in range(n)]
        self.weight_version = 0
        self.num_cached_tokens = 0
        self.child_ids = [request_id] if n == 1 else [f"{request_id}-{i}" for i in range(n)]

    def index_of(self, child_id: str) -> int:
        return 0 if len(self.child_ids) == 1 else int(child_id.rsplit("-", 1)[1])

    def add(self, out: EngineOutput) -> None:
        c = self.outputs[self.index_of(out.request_id)]
        c.text += out.new_text
        c.token_ids.extend(out.new_token_ids)
        c.token_versions.extend(out.token_versions if out.token_versions is not None
                                else [out.weight_version] * len(out.new_token_ids))
        if out.new_logprobs is not None and c.logprobs is not None:
            c.logprobs.extend(out.new_logprobs)
        if out.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = list(out.prompt_logprobs)
        if out.finish_reason is not None:
            c.finish_reason = out.finish_reason.value
            c.stop_reason = out.stop_reason
        self.weight_version = out.weight_version
        self.num_cached_tokens = max(self.num_cached_tokens, out.num_cached_tokens)

    @property
    def finished(self) -> bool:
        return all(c.finish_reason is not None for c in self.outputs)

    def snapshot(self) -> RequestOutput:
        """A cumulative RequestOutput; lists are copied so later deltas do not leak in."""
        outs = [CompletionOutput(c.index, c.text, list(c.token_ids),
                                 None if c.logprobs is None else list(c.logprobs),
                                 c.finish_reason, c.stop_reason, list(c.token_versions))
                for c in self.outputs]
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids,
                             self.prompt_logprobs, outs, self.finished, self.weight_version,
                             self.num_cached_tokens)
