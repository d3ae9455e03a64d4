"""Sampling defaults from a model's generation_config.json, with vLLM's `--generation-config`:

    auto   the model's generation_config.json, when it has one (vLLM's default)
    vllm   none: OpenAI's and vLLM's own defaults
    PATH   the generation_config.json in that folder (or that file)

`--override-generation-config '{"temperature": 0.5}'` is laid over whichever applies.
A request's own fields always win. `max_new_tokens` becomes a server-wide limit on
max_tokens, as in vLLM; the others are defaults for requests that leave them unset.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

from rlserve.sampling_params import InvalidRequestError, SamplingParams

logger = logging.getLogger(__name__)

# generation_config.json key -> request field (vLLM reads the same ones).
KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
        "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}
FILENAME = "generation_config.json"


def _read(path: str) -> dict[str, Any]:
    file = os.path.join(path, FILENAME) if os.path.isdir(path) else path
    with open(file, encoding="utf-8") as f:
        data = json.load(f)
    if not isinstance(data, dict):
        raise ValueError(f"{file}: not a JSON object")
    return data


def generation_defaults(source: str, model_path: str | None,
                        overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """Request field -> default value. Raises ValueError naming the flag for a file that is
    missing (PATH), unreadable, or holds a value no request could."""
    if source == "vllm":
        data: dict[str, Any] = {}
    elif source == "auto":
        data = {}
        if model_path is not None and os.path.isfile(os.path.join(model_path, FILENAME)):
            data = _read(model_path)
    else:
        if not os.path.exists(source):
            raise ValueError(f"--generation-config: {source!r} is neither auto, vllm nor a path "
                             f"that exists (a folder with {FILENAME}, or the file)")
        data = _read(source)
    data = {**data, **(overrides or {})}
    defaults = {field: data[key] for key, field in KEYS.items() if data.get(key) is not None}
    try:
        SamplingParams(**defaults)  # a value no request could set is refused here, not per request
    except (InvalidRequestError, TypeError) as e:
        raise ValueError(f"--generation-config: {e}") from None
    if defaults:
        logger.warning("default sampling parameters from the generation config (--generation-config "
                       "%s; a request's own fields win): %s", source, defaults)
    return defaults
