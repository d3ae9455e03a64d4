"""rlserve: a rollout server for RL post-training with live weight updates."""

from rlserve.sampling_params import SamplingParams
from rlserve.version import __version__

__all__ = ["LLM", "SamplingParams", "RequestOutput", "__version__"]


def __getattr__(name):
    # The engine is imported on first use: importing `rlserve` (and so any of its modules,
    # a worker process's included) stays light and below rlserve.engine.
    if name == "LLM":
        from rlserve.llm import LLM
        return LLM
    if name == "RequestOutput":
        from rlserve.frontend.request_output import RequestOutput
        return RequestOutput
    raise AttributeError(name)
