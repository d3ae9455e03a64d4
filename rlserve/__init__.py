"""rlserve: a rollout server for RL post-training with live weight updates."""

from rlserve.engine.request import RequestOutput, SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "RequestOutput", "__version__"]


def __getattr__(name):
    # LLM pulls in the engine; importing `rlserve` alone stays light.
    if name == "LLM":
        from rlserve.engine.llm import LLM
        return LLM
    raise AttributeError(name)
