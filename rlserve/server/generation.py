"""What the completions and chat flows wait on and read: the engine requests one HTTP
request made."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from rlserve.frontend.output_processor import RequestState
from rlserve.sampling_params import SamplingParams
from rlserve.server.metrics import ServerMetrics
from rlserve.server.prompts import Prompt
from rlserve.wire.validation import validate_prompt

if TYPE_CHECKING:
    from rlserve.frontend.async_engine import AsyncEngine


class Generation:
    """The engine requests behind one HTTP request: one per prompt, all n samples each.

    Whoever serves the HTTP request waits on it (`wait`, `finished`) and reads each
    request's state; `close` ends whatever still runs (the client left, or an error).
    """

    def __init__(
        self,
        engine: AsyncEngine,
        request_id: str,
        prompts: list[Prompt],
        params: SamplingParams,
        arrival: float,
        stream: bool,
        cache_salt: str | None = None,
        lora_name: str | None = None,
        metrics: ServerMetrics | None = None,
    ):
        for p in prompts:  # all checked before any is sent
            validate_prompt(p.token_ids, params, engine.max_model_len, engine.vocab_size, engine.max_logprobs)
        self.engine = engine
        self.metrics = metrics
        self.closed = False
        self.changed = asyncio.Event()
        ids = [request_id] if len(prompts) == 1 else [f"{request_id}-{i}" for i in range(len(prompts))]
        self.states: list[RequestState] = []
        try:
            for p, rid in zip(prompts, ids):
                self.states.append(
                    engine.add_request(
                        p.token_ids,
                        params,
                        request_id=rid,
                        prompt=p.text,
                        arrival=arrival,
                        notify=self.changed.set,
                        stream=stream,
                        cache_salt=cache_salt,
                        lora_name=lora_name,
                    )
                )
        except BaseException:
            self.close()
            raise

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.states)

    def _raise_error(self) -> None:
        for s in self.states:
            if s.error is not None:
                raise s.error

    async def wait(self) -> None:
        """Until some request changed; raises a request's error."""
        await self.changed.wait()
        self.changed.clear()
        self._raise_error()

    async def turns(self) -> AsyncIterator[None]:
        """A streamed response's rhythm: once now, then once each time a request changed,
        until every request has finished; each turn the caller sends what is new."""
        while True:
            yield
            if self.finished:
                return
            await self.wait()

    async def until_started(self) -> None:
        """Until every request has produced something (or ended): an invalid request
        then fails before a stream's 200 is sent."""
        while not all(s.finished or any(x.token_ids for x in s.samples) for s in self.states):
            await self.wait()
        self._raise_error()

    async def until_finished(self) -> None:
        while not self.finished:
            await self.wait()
        self._raise_error()

    def close(self) -> None:
        for s in self.states:
            self.engine.release(s)
        if self.metrics is not None and not self.closed:
            self.metrics.requests_done([s for s in self.states if s.finished and s.error is None])
        self.closed = True
