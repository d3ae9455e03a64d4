"""rlserve's environment variables, in one table: each one's name, type, default and meaning.

Every module reads the environment through here (tests/unit/test_structure.py checks), always
at the moment it needs the value: `envs.RLSERVE_KERNELS.get()`. The few read when their
module is imported say so (`at_import`): a Triton kernel's launch mode and its
interpreter's quirks are fixed when the kernels are defined. A variable set but empty
counts as unset. What rlserve sets for its child processes is beside the spawn helper
(process.py). docs/serving.md lists this table.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class EnvVar(Generic[T]):
    name: str
    kind: str  # the type, as the docs write it
    parse: Callable[[str], T]  # the text -> the value; ValueError when it is malformed
    default: T
    help: str
    at_import: bool = False  # read once, when the module that uses it is imported

    def get(self) -> T:
        """The value, or the default when unset or empty; ValueError naming the variable
        when the text is malformed."""
        text = os.environ.get(self.name, "")
        if not text:
            return self.default
        try:
            return self.parse(text)
        except ValueError as e:
            raise ValueError(f"{self.name}: {e}") from None

    def raw(self) -> str | None:
        """The text as set, empty included (a key set to nothing is an error, not unset)."""
        return os.environ.get(self.name)


def _switch(text: str) -> bool:
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"must be 1 or 0 (true or false), got {text!r}")


def _triton_switch(text: str) -> bool:
    """As Triton reads its own switches: these words are on, anything else off."""
    return text.lower() in ("1", "true", "on", "yes")


def _dp_engines(text: str) -> list[dict[str, str]]:
    engines = json.loads(text)
    if not (isinstance(engines, list)
            and all(isinstance(e, dict) and set(e) == {"input", "output"} for e in engines)):
        raise ValueError('must be a JSON list of {"input": ..., "output": ...}')
    return engines


VARIABLES: list[EnvVar[Any]] = []


def _var(name: str, kind: str, help: str, default: Any = None, parse: Callable[[str], Any] = str,
         at_import: bool = False) -> EnvVar[Any]:
    var = EnvVar(name, kind, parse, default, help, at_import)
    VARIABLES.append(var)
    return var


# -- where things are ---------------------------------------------------------------------
RLSERVE_CACHE: EnvVar[str | None] = _var(
    "RLSERVE_CACHE", "path", "where the demo model is converted to, once "
    "(default: $XDG_CACHE_HOME/rlserve, else ~/.cache/rlserve)")
XDG_CACHE_HOME: EnvVar[str | None] = _var(
    "XDG_CACHE_HOME", "path", "the user's cache folder, under which RLSERVE_CACHE defaults "
    "(default: ~/.cache)")
RLSERVE_DEMO_MODEL: EnvVar[str | None] = _var(
    "RLSERVE_DEMO_MODEL", "path", "an HF directory served when no MODEL is given, instead of "
    "the converted demo model")

# -- the server ---------------------------------------------------------------------------
VLLM_API_KEY: EnvVar[str | None] = _var(
    "VLLM_API_KEY", "secret", "--api-key when neither it nor --api-key-file is given (as in vLLM)")
RLSERVE_API_KEY: EnvVar[str | None] = _var(
    "RLSERVE_API_KEY", "secret", "--api-key when neither it, --api-key-file nor VLLM_API_KEY is given")
RLSERVE_ADMIN_KEY: EnvVar[str | None] = _var(
    "RLSERVE_ADMIN_KEY", "secret", "--admin-key when neither it nor --admin-key-file is given")
RLSERVE_DP_ENGINES: EnvVar[list[dict[str, str]] | None] = _var(
    "RLSERVE_DP_ENGINES", "JSON", 'data-parallel replicas started elsewhere, '
    '[{"input": zmq address, "output": zmq address}, ...], that `rlserve serve` attaches to '
    "instead of starting its own (rlserve.ray sets it for its router)", parse=_dp_engines)
VLLM_HOST_IP: EnvVar[str | None] = _var(
    "VLLM_HOST_IP", "address", "what get_ip() answers, as in vLLM (default: the address of "
    "the interface that routes outward)")

# -- kernels ------------------------------------------------------------------------------
RLSERVE_KERNELS: EnvVar[str | None] = _var(
    "RLSERVE_KERNELS", "torch or triton", "the kernel set a model runs (default: triton on CUDA "
    "where it imports, torch elsewhere)")
VLLM_BATCH_INVARIANT: EnvVar[bool] = _var(
    "VLLM_BATCH_INVARIANT", "0 or 1", "1: --batch-invariant, as vLLM reads it (a request's tokens "
    "and logprobs do not depend on what else shares its steps; docs/on-policy.md)",
    default=False, parse=_switch)
RLSERVE_GDN_DECODE: EnvVar[str | None] = _var(
    "RLSERVE_GDN_DECODE", "fla or triton", "hybrid models on CUDA: a linear-attention decode step "
    "through fla-core's recurrent kernel (states gathered and scattered around it) or through "
    "rlserve's kernel on the state pool in place (default: fla; without fla-core, the torch "
    "recurrence)")
RLSERVE_PDL: EnvVar[bool] = _var(
    "RLSERVE_PDL", "0 or 1", "0: every Triton kernel launches plainly, without programmatic "
    "dependent launch (a debugging aid; the results are the same)", default=True,
    parse=_switch, at_import=True)
TRITON_INTERPRET: EnvVar[bool] = _var(
    "TRITON_INTERPRET", "0 or 1", "Triton's own: kernels run in its interpreter (read as Triton "
    "reads it); rlserve's MoE kernel then multiplies bfloat16 tiles in float32, which the "
    "interpreter gets wrong", default=False, parse=_triton_switch, at_import=True)

# -- profiling ----------------------------------------------------------------------------
RLSERVE_ENGINE_PROFILE: EnvVar[str | None] = _var(
    "RLSERVE_ENGINE_PROFILE", "path", "a cProfile of the engine's step loop, written to this "
    "path when the engine exits")
RLSERVE_API_PROFILE: EnvVar[str | None] = _var(
    "RLSERVE_API_PROFILE", "path", "a cProfile of each API server's event loop, written to "
    "PATH.<pid> when it exits")

# -- the test suite -----------------------------------------------------------------------
RLSERVE_TRITON_INTERPRET: EnvVar[bool] = _var(
    "RLSERVE_TRITON_INTERPRET", "0 or 1", "tests: the Triton kernel tests run on the CPU under "
    "Triton's interpreter (they set TRITON_INTERPRET before the kernels are defined)",
    default=False, parse=_switch, at_import=True)
RLSERVE_TEST_SERVER_TIMEOUT: EnvVar[float] = _var(
    "RLSERVE_TEST_SERVER_TIMEOUT", "seconds", "tests: how long a test's server may take to "
    "start", default=180.0, parse=float)
RLSERVE_TEST_TOKENIZER: EnvVar[str | None] = _var(
    "RLSERVE_TEST_TOKENIZER", "path", "tests: the tokenizer folder of the two-server GPU test "
    "(default: the demo model's)")
