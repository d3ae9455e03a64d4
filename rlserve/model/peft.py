"""LoRA adapters in PEFT's format: their configuration, tensor names and files on disk.

A PEFT adapter is a directory with `adapter_config.json` (r, lora_alpha, use_rslora,
target_modules, rank_pattern, alpha_pattern, ...) and `adapter_model.safetensors` whose
tensors are named `base_model.model.<HF module>.lora_A.weight` ([r, in]) and
`...lora_B.weight` ([out, r]). Scaling is lora_alpha / r, or lora_alpha / sqrt(r) with
use_rslora; rank_pattern / alpha_pattern override r / lora_alpha for the modules whose
name ends with a pattern key, as PEFT matches them. This module only reads, checks and
names them: the engine keeps its table of loaded adapters (rlserve.engine.lora), a worker
puts the tensors in slots (rlserve.model.lora), a trainer sends them
(rlserve.weight_transfer.trainer.client).
"""
from __future__ import annotations

import io
import math
import os
import re
import stat
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import regex  # type: ignore[import-untyped]
import torch

from rlserve import json_depth
from rlserve.errors import ModelNotFoundError
from rlserve.sampling_params import InvalidRequestError

PEFT_PREFIX = "base_model.model."
# ".lora_A.weight", also with PEFT's in-memory adapter name (".lora_A.default.weight")
_PEFT_NAME = re.compile(r"^(?P<module>.+)\.lora_(?P<kind>[AB])(?:\.[^.]+)?\.weight$")
# Features of PEFT's LoRA that change the computation beyond y += s * B A x: refused.
_UNSUPPORTED: dict[str, tuple[Any, Any]] = {
    "use_dora": (False, None), "modules_to_save": (None, []), "bias": ("none", None),
    "trainable_token_indices": (None, {}), "lora_bias": (False, None), "layer_replication": (None, [])}


def peft_name(module: str, kind: str) -> str:
    """The canonical PEFT name of `module`'s lora_A (kind "A") or lora_B ("B") weight."""
    return f"{PEFT_PREFIX}{module}.lora_{kind}.weight"


def parse_peft_name(name: str) -> tuple[str, str] | None:
    """(HF module, "A" | "B") of a PEFT LoRA tensor name, or None if it is not one."""
    m = _PEFT_NAME.match(name.removeprefix(PEFT_PREFIX))
    return (m["module"], m["kind"]) if m else None


def canonical_peft_names(named: Iterable[tuple[str, Any]]) -> list[tuple[str, Any]]:
    """PEFT LoRA tensors under their canonical names (a PeftModel's named_parameters carry
    the adapter's name, `lora_A.default.weight`); every other tensor is dropped."""
    out = []
    for name, value in named:
        parsed = parse_peft_name(name)
        if parsed is not None:
            out.append((peft_name(*parsed), value))
    return out


def peft_adapter_tensors(peft_model, adapter: str | None = None) -> tuple[dict[str, Any], list[tuple[str, Any]]]:
    """A PeftModel's adapter (its active one by default) as an update carries it: the
    config's fields rlserve uses, and its LoRA tensors under their canonical PEFT names."""
    adapter = adapter or peft_model.active_adapter
    if adapter not in peft_model.peft_config:
        raise ValueError(f"adapter: {adapter!r} is not one of the model's ({', '.join(peft_model.peft_config)})")
    data = peft_model.peft_config[adapter].to_dict()
    for key, value in data.items():  # sets (target_modules) and enums, as JSON has them
        if isinstance(value, (set, frozenset)):
            data[key] = sorted(value)
    data["peft_type"] = str(getattr(data.get("peft_type"), "value", data.get("peft_type") or "LORA"))
    config = LoRAConfig.parse(data, "lora_config", max_rank=1 << 30)
    tensors = []
    for name, tensor in peft_model.named_parameters():
        if ".lora_" not in name:  # the base model's weights: most of the walk
            continue
        m = _PEFT_NAME.match(name.removeprefix(PEFT_PREFIX))
        # PEFT's in-memory names carry the adapter: "...lora_A.<adapter>.weight"
        if m and name.endswith(f".lora_{m['kind']}.{adapter}.weight"):
            tensors.append((peft_name(m["module"], m["kind"]), tensor.detach()))
    if not tensors:
        raise ValueError(f"adapter {adapter!r} has no LoRA tensors")
    return config.to_wire(), tensors


# PEFT matches module names with the config's regexes. A pattern such as `(.|.){0,24}Z`
# takes exponential time to fail in a backtracking engine: every match runs under the
# `regex` module's timeout, and patterns are bounded in length and number.
MAX_PATTERN_CHARS = 512
MAX_PATTERNS = 1024
MATCH_TIMEOUT_S = 0.05
PATTERNS_BUDGET_S = 0.5


def _compile(pattern: str) -> Any:
    return regex.compile(rf"(.*\.)?({pattern})$")


def _regex_problem(pattern: str) -> str | None:
    """What is wrong with `pattern` as a regex (PEFT matches module names with it), or None."""
    if len(pattern) > MAX_PATTERN_CHARS:
        return f"longer than {MAX_PATTERN_CHARS} characters"
    try:
        regex.compile(pattern)  # its errors' positions are in the pattern as written
        _compile(pattern).match("model.layers.0.self_attn.q_proj", timeout=MATCH_TIMEOUT_S)
    except (regex.error, RecursionError, OverflowError, ValueError) as e:
        return str(e) if not isinstance(e, RecursionError) else "nested too deep"
    except TimeoutError:
        return f"takes more than {MATCH_TIMEOUT_S}s to match a module name (catastrophic backtracking)"
    return None


def _bad_patterns(patterns: Mapping[str, Any]) -> list[str]:
    """Each pattern that is not a usable regex, with why; all of them checked within
    PATTERNS_BUDGET_S (a config of many slow patterns is refused as a whole)."""
    deadline = time.monotonic() + PATTERNS_BUDGET_S
    bad = []
    for key in patterns:
        if time.monotonic() > deadline:
            bad.append(f"checking the patterns took more than {PATTERNS_BUDGET_S}s")
            break
        why = _regex_problem(key)
        if why:
            bad.append(f"{key!r:.80} ({why})")
    return bad


def _pattern_value(patterns: Mapping[str, Any], module: str, default: Any) -> Any:
    for key, value in patterns.items():  # PEFT's get_pattern_key: the module name ends with the key
        try:
            found = _compile(key).match(module, timeout=MATCH_TIMEOUT_S)
        except TimeoutError:
            raise InvalidRequestError(f"rank_pattern/alpha_pattern: {key!r:.80} takes more than "
                                      f"{MATCH_TIMEOUT_S}s to match {module!r}", "lora_config") from None
        if found:
            return value
    return default


@dataclass(frozen=True)
class LoRAConfig:
    """What rlserve uses of a PEFT LoraConfig."""

    r: int
    lora_alpha: float
    use_rslora: bool = False
    target_modules: tuple[str, ...] | str | None = None  # informational: the tensors decide
    rank_pattern: dict[str, int] = field(default_factory=dict)
    alpha_pattern: dict[str, float] = field(default_factory=dict)

    def rank(self, module: str) -> int:
        return int(_pattern_value(self.rank_pattern, module, self.r))

    def scaling(self, module: str) -> float:
        r = self.rank(module)
        alpha = float(_pattern_value(self.alpha_pattern, module, self.lora_alpha))
        return alpha / math.sqrt(r) if self.use_rslora else alpha / r

    @property
    def max_rank(self) -> int:
        return max([self.r, *self.rank_pattern.values()])

    @classmethod
    def parse(cls, data: Any, where: str, max_rank: int) -> LoRAConfig:
        """From adapter_config.json (or an update's lora_config): every problem named,
        `where` saying which input it is."""
        if not isinstance(data, Mapping):
            raise InvalidRequestError(f"{where}: must be a JSON object (PEFT's adapter_config)", where)
        peft_type = data.get("peft_type", "LORA")
        if peft_type != "LORA":
            raise InvalidRequestError(f"{where}.peft_type: only LORA adapters are served, got {peft_type!r}", where)
        problems = []
        r, alpha = data.get("r"), data.get("lora_alpha", 8)  # PEFT's default alpha
        if not (isinstance(r, int) and not isinstance(r, bool) and r >= 1):
            problems.append(f"r must be a positive integer, got {r!r}")
        if not (isinstance(alpha, (int, float)) and not isinstance(alpha, bool) and math.isfinite(alpha)):
            problems.append(f"lora_alpha must be a number, got {alpha!r}")
        rslora = data.get("use_rslora", False)
        if not isinstance(rslora, bool):
            problems.append(f"use_rslora must be true or false, got {rslora!r}")
        targets = data.get("target_modules")
        if not (targets is None or isinstance(targets, str)
                or (isinstance(targets, list) and all(isinstance(t, str) for t in targets))):
            problems.append(f"target_modules must be a list of names or a regex, got {targets!r}")
        elif isinstance(targets, str) and _regex_problem(targets):
            problems.append(f"target_modules is not a valid regex: {_regex_problem(targets)}")
        patterns = {}
        for key, kind in (("rank_pattern", int), ("alpha_pattern", (int, float))):
            value = data.get(key) or {}
            if isinstance(value, Mapping) and len(value) > MAX_PATTERNS:
                problems.append(f"{key}: at most {MAX_PATTERNS} patterns, got {len(value)}")
                value = {}
            if not (isinstance(value, Mapping) and all(
                    isinstance(k, str) and isinstance(v, kind) and not isinstance(v, bool) and v > 0
                    for k, v in value.items())):
                problems.append(f"{key} must map module names to positive numbers, got {value!r:.200}")
                value = {}
            bad_keys = _bad_patterns(value)
            if bad_keys:
                problems.append(f"{key}: keys are module-name patterns, not valid regexes: {', '.join(bad_keys)}")
                value = {}
            patterns[key] = dict(value)
        for key, allowed in _UNSUPPORTED.items():
            if key in data and data[key] not in allowed:
                problems.append(f"{key}={data[key]!r} is not supported (LoRA's y += B A x only)")
        if problems:
            raise InvalidRequestError(f"{where}: " + "; ".join(problems), where)
        assert isinstance(r, int)  # checked above
        config = cls(r, float(alpha), rslora, tuple(targets) if isinstance(targets, list) else targets,
                     patterns["rank_pattern"], patterns["alpha_pattern"])
        if config.max_rank > max_rank:
            raise InvalidRequestError(f"{where}: rank {config.max_rank} exceeds max_lora_rank ({max_rank}); "
                                      "start the server with a larger --max-lora-rank", where)
        return config

    def to_wire(self) -> dict[str, Any]:
        """Plain data (msgpack, JSON); `parse` reads it back."""
        return {"r": self.r, "lora_alpha": self.lora_alpha, "use_rslora": self.use_rslora,
                "target_modules": list(self.target_modules) if isinstance(self.target_modules, tuple)
                else self.target_modules,
                "rank_pattern": self.rank_pattern, "alpha_pattern": self.alpha_pattern}


def pair_tensors(named: Iterable[tuple[str, torch.Tensor]], config: LoRAConfig, where: str,
                 exempt: tuple[str, ...] = ()) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """PEFT-named tensors -> {HF module: (A, B)}. Refuses names that are not LoRA weights,
    modules under an `exempt` prefix (a mixture-of-experts block: LoRAModel.exempt), a
    module with A but no B (or the reverse), and ranks other than the config's."""
    halves: dict[str, dict[str, torch.Tensor]] = {}
    bad = []
    for name, tensor in named:
        parsed = parse_peft_name(name)
        if parsed is None:
            bad.append(name)
            continue
        halves.setdefault(parsed[0], {})[parsed[1]] = tensor
    problems = []
    refused = sorted(m for m in halves if m.startswith(exempt)) if exempt else []
    if refused:
        problems.append(f"expert and router weights take no adapters (the attention projections and "
                        f"dense MLP layers do): {', '.join(refused[:10])}")
        halves = {m: h for m, h in halves.items() if m not in refused}
    if bad:
        problems.append(f"not LoRA weights (expected {PEFT_PREFIX}<module>.lora_A.weight / "
                        f".lora_B.weight): {', '.join(bad[:10])}")
    unpaired = [f"{m} has only lora_{next(iter(h))}" for m, h in halves.items() if len(h) != 2]
    if unpaired:
        problems.append("; ".join(unpaired[:10]))
    pairs = {m: (h["A"], h["B"]) for m, h in halves.items() if len(h) == 2}
    wrong_rank = [f"{m} (lora_A {list(a.shape)}, lora_B {list(b.shape)}, r={config.rank(m)})"
                  for m, (a, b) in pairs.items()
                  if a.dim() != 2 or b.dim() != 2 or a.shape[0] != config.rank(m) or b.shape[1] != config.rank(m)]
    if wrong_rank:
        problems.append(f"shapes do not match the adapter's rank: {', '.join(wrong_rank[:10])}")
    if not pairs and not problems:
        problems.append("no LoRA tensors")
    if problems:
        raise InvalidRequestError(f"{where}: " + "; ".join(problems), where)
    return pairs


MAX_CONFIG_BYTES = 1 << 20  # adapter_config.json: a few kB in practice
MAX_ADAPTER_BYTES = 16 << 30  # the tensors' file: a rank-256 adapter of a 70B model is a few GB


def _read_regular(directory: str, name: str, limit: int) -> bytes | None:
    """The bytes of `directory/name`, or None if there is no such file. Refuses what is not
    a regular file (a FIFO would block the reader until someone writes to it; a device
    never ends), a link that leads out of the adapter's directory, and a file over `limit`."""
    file = os.path.join(directory, name)
    if not os.path.lexists(file):
        return None
    real, root = os.path.realpath(file), os.path.realpath(directory)
    if os.path.commonpath([real, root]) != root:
        raise InvalidRequestError(f"lora_path: {file} links out of the adapter's directory (to {real})", "lora_path")
    try:
        # O_NONBLOCK: opening a FIFO returns at once (fstat then refuses it) instead of blocking
        fd = os.open(file, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except OSError as e:
        raise InvalidRequestError(f"lora_path: cannot open {file}: {e.strerror}", "lora_path") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise InvalidRequestError(f"lora_path: {file} is not a regular file", "lora_path")
        if info.st_size > limit:
            raise InvalidRequestError(f"lora_path: {file} is {info.st_size} bytes, over the limit of {limit}",
                                      "lora_path")
        with os.fdopen(fd, "rb", closefd=False) as f:
            data = f.read(limit + 1)
    except OSError as e:
        raise InvalidRequestError(f"lora_path: cannot read {file}: {e.strerror}", "lora_path") from None
    finally:
        os.close(fd)
    if len(data) > limit:  # grew while read
        raise InvalidRequestError(f"lora_path: {file} is over the limit of {limit} bytes", "lora_path")
    return data


def _load_tensors(path: str) -> list[tuple[str, torch.Tensor]]:
    """The adapter's tensors, from bytes read with the checks above; a corrupt file is the
    caller's error (400), named."""
    for name in ("adapter_model.safetensors", "adapter_model.bin"):
        data = _read_regular(path, name, MAX_ADAPTER_BYTES)
        if data is None:
            continue
        try:
            if name.endswith(".safetensors"):
                from safetensors.torch import load as load_safetensors
                return list(load_safetensors(data).items())
            state = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
            if not isinstance(state, Mapping) or not all(isinstance(t, torch.Tensor) for t in state.values()):
                raise ValueError("not a mapping of names to tensors")
            return list(state.items())
        except Exception as e:  # safetensors' SafetensorError, pickle's many errors: the file is bad
            raise InvalidRequestError(f"lora_path: {os.path.join(path, name)} is not a valid "
                                      f"{'safetensors' if name.endswith('.safetensors') else 'weights-only torch'} "
                                      f"file: {str(e)[:300]}", "lora_path") from None
    raise InvalidRequestError(f"lora_path: {path} has no adapter_model.safetensors", "lora_path")


def read_adapter(path: str, max_rank: int) -> tuple[LoRAConfig, list[tuple[str, torch.Tensor]]]:
    """A PEFT adapter directory: its config and tensors (safetensors, or a weights-only
    adapter_model.bin). Every file is checked before it is read (regular, inside the
    directory, bounded): see _read_regular."""
    if not os.path.isdir(path):  # vLLM's LoRAAdapterNotFoundError: a 404
        raise ModelNotFoundError(f"lora_path: no adapter found for {path!r} (not a directory on "
                                 "the server)", "lora_path")
    config_file = os.path.join(path, "adapter_config.json")
    raw = _read_regular(path, "adapter_config.json", MAX_CONFIG_BYTES)
    if raw is None:
        raise InvalidRequestError(f"lora_path: cannot read {config_file}: no such file", "lora_path")
    try:
        data = json_depth.loads(raw.decode())
    except (ValueError, UnicodeDecodeError) as e:
        raise InvalidRequestError(f"lora_path: cannot read {config_file}: {e}", "lora_path") from None
    if isinstance(data, Mapping) and str(data.get("init_lora_weights", "")).lower().startswith("pissa"):
        # vLLM refuses these too: a PiSSA adapter's base is the residual left after its
        # principal components were moved into A and B, not the served weights.
        raise InvalidRequestError(f"lora_path: {path} is a PiSSA adapter (init_lora_weights "
                                  f"{data['init_lora_weights']!r}): it needs its own residual base weights; "
                                  "convert it to a plain LoRA adapter (PEFT's "
                                  "path_initial_model_for_weight_conversion) to serve it", "lora_path")
    config = LoRAConfig.parse(data, "adapter_config", max_rank)
    return config, _load_tensors(path)
