"""Loading a LoRA adapter from disk is bounded and never a 500: a module pattern that
backtracks, a FIFO or a link out of the adapter's directory, a corrupt or truncated
safetensors file, a PiSSA adapter, a second load of one name: each a 4xx that names it,
answered at once, while generation goes on."""

from __future__ import annotations

import json
import os
import random
import struct
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch

from helpers.servers import start_tiny_server, stop_server


@pytest.fixture(scope="module")
def good(tmp_path_factory) -> Path:
    """A PEFT adapter of the tiny model (rank 4 on q_proj and v_proj)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    from rlserve.model.presets import model_dir
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir("tiny")))
    peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    path = tmp_path_factory.mktemp("adapters") / "good"
    peft_model.save_pretrained(str(path))
    return path


@pytest.fixture(scope="module")
def server(tmp_path_factory, good):
    srv = start_tiny_server(tmp_path_factory.mktemp("lora-files") / "s.log", "--enable-lora",
                            "--max-lora-rank", "16", "--max-loras", "2", "--max-cpu-loras", "4",
                            "--lora-modules", f"good={good}")
    yield srv
    stop_server(srv)


def variant(good: Path, root: Path, name: str, config: dict | None = None, tensors: bytes | None = None) -> Path:
    """A copy of the good adapter with its config changed by `config` (merged) and/or its
    safetensors file replaced by `tensors`."""
    path = root / name
    path.mkdir()
    data = json.loads((good / "adapter_config.json").read_text())
    (path / "adapter_config.json").write_text(json.dumps({**data, **(config or {})}))
    st = (good / "adapter_model.safetensors").read_bytes()
    (path / "adapter_model.safetensors").write_bytes(st if tensors is None else tensors)
    return path


def load(url: str, name: str, path: Path | str, **extra) -> httpx.Response:
    return httpx.post(f"{url}/v1/load_lora_adapter", timeout=60,
                      json={"lora_name": name, "lora_path": str(path), **extra})


def generate(url: str, model: str = "good") -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", timeout=60,
                      json=dict(model=model, prompt=[1, 2, 3], max_tokens=3, temperature=0))


def bad_adapters(good: Path, root: Path) -> list[tuple[str, Path]]:
    """(what is wrong, the adapter directory) for every kind of bad file."""
    st = (good / "adapter_model.safetensors").read_bytes()
    header_len = struct.unpack("<Q", st[:8])[0]
    rng = random.Random(3)
    cases: list[tuple[str, Path]] = []

    def add(why: str, **kw) -> None:
        cases.append((why, variant(good, root, f"bad{len(cases)}", **kw)))

    add("backtracking rank_pattern", config={"rank_pattern": {"(.|.){0,24}Z": 8}})
    add("backtracking alpha_pattern", config={"alpha_pattern": {"(a|aa|a?){0,30}Z": 4}})
    add("overlong pattern", config={"rank_pattern": {"q" * 5000: 8}})
    add("invalid regex", config={"rank_pattern": {"([": 8}})
    add("empty safetensors", tensors=b"")
    add("truncated safetensors", tensors=st[: len(st) // 2])
    add("truncated header", tensors=st[:8 + header_len // 2])
    add("huge header", tensors=struct.pack("<Q", 1 << 40) + st[8:])
    add("garbage header", tensors=struct.pack("<Q", 64) + b"{" * 64 + st[72:])
    for i in range(8):
        flipped = bytearray(st)
        for _ in range(16):
            flipped[rng.randrange(8, 8 + header_len)] = rng.randrange(256)
        add(f"corrupt header {i}", tensors=bytes(flipped))
    add("pissa", config={"init_lora_weights": "pissa"})
    add("pissa_niter", config={"init_lora_weights": "pissa_niter_4"})
    fifo = variant(good, root, "fifo")
    os.unlink(fifo / "adapter_config.json")
    os.mkfifo(fifo / "adapter_config.json")
    cases.append(("FIFO config", fifo))
    fifo_st = variant(good, root, "fifo-st")
    os.unlink(fifo_st / "adapter_model.safetensors")
    os.mkfifo(fifo_st / "adapter_model.safetensors")
    cases.append(("FIFO tensors", fifo_st))
    link = variant(good, root, "link")
    os.unlink(link / "adapter_config.json")
    os.symlink("/etc/hostname", link / "adapter_config.json")
    cases.append(("link out of the directory", link))
    device = variant(good, root, "device")
    os.unlink(device / "adapter_model.safetensors")
    os.symlink("/dev/zero", device / "adapter_model.safetensors")
    cases.append(("link to a device", device))
    return cases


def test_bad_adapter_files_are_4xx_at_once_while_generation_goes_on(server, good, tmp_path):
    url = server.url
    stop, gaps = threading.Event(), []

    def stream() -> None:  # tokens keep coming while the loads run
        while not stop.is_set():
            body = dict(model="m", prompt=[1, 2, 3], max_tokens=400, ignore_eos=True, stream=True)
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
                last = time.monotonic()
                for _ in r.iter_lines():
                    now = time.monotonic()
                    gaps.append(now - last)
                    last = now
                    if stop.is_set():
                        break

    streamer = threading.Thread(target=stream)
    streamer.start()
    failures = []
    try:
        for why, path in bad_adapters(good, tmp_path):
            t0 = time.monotonic()
            r = load(url, path.name, path)
            seconds = time.monotonic() - t0
            if r.status_code not in (200, 400) or seconds > 5:
                failures.append(f"{why}: {r.status_code} in {seconds:.1f}s: {r.text[:200]}")
            elif r.status_code == 400 and r.json()["error"]["param"] not in ("lora_path", "adapter_config"):
                failures.append(f"{why}: the 400 does not name the adapter's file: {r.text[:200]}")
            if why.startswith(("empty", "truncated", "huge", "garbage", "FIFO", "link", "pissa")) \
                    and r.status_code != 400:
                failures.append(f"{why}: expected a 400, got {r.status_code}: {r.text[:200]}")
    finally:
        stop.set()
        streamer.join(60)
    assert not failures, "\n".join(failures)
    assert gaps and max(gaps) < 1.0, f"generation stalled {max(gaps):.2f}s while adapters loaded"
    assert generate(url).status_code == 200


def test_a_pissa_adapter_is_refused_naming_why(server, good, tmp_path):
    r = load(server.url, "p", variant(good, tmp_path, "p", config={"init_lora_weights": "pissa"}))
    assert r.status_code == 400 and "PiSSA" in r.json()["error"]["message"], r.text


def test_a_second_load_of_one_name_has_already_been_loaded(server, good):
    r = load(server.url, "good", good)
    assert r.status_code == 400 and "has already been loaded" in r.json()["error"]["message"], r.text


def test_a_failed_in_place_load_keeps_the_adapter_serving(server, good, tmp_path):
    before = generate(server.url).json()["choices"][0]["text"]
    broken = variant(good, tmp_path, "broken", tensors=b"\x00" * 7)
    r = load(server.url, "good", broken, load_inplace=True)
    assert r.status_code == 400 and "adapter_model.safetensors" in r.text, r.text
    assert generate(server.url).json()["choices"][0]["text"] == before
