"""`rlserve serve`'s flags: generated from EngineConfig's fields (the engine's) and
ServeOptions' (the server's), name, default and help; every flag a command line could use
keeps its name and meaning."""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import sys

import pytest

from rlserve.cli import build_parser, config_from_args
from rlserve.config import EngineConfig, WeightTransferConfig
from rlserve.flags import flag_name, flag_values
from rlserve.server.options import ServeOptions

# Every flag `rlserve serve` had before its engine flags were generated.
FLAGS = [
    "--host", "--port", "--served-model-name", "--api-key", "--admin-key", "--allow-remote-control",
    "--chat-template", "--log-level", "--uvicorn-log-level", "--disable-log-requests", "--disable-log-stats",
    "--api-server-count", "--max-request-body-bytes", "--max-prompts-per-request", "--shutdown-grace-period",
    "--engine-death-linger", "--tokenizer", "--device", "--dtype", "--load-format", "--max-model-len", "--seed",
    "--trust-remote-code", "--generation-config", "--override-generation-config", "--logprobs-mode",
    "--max-logprobs", "--return-tokens-as-token-ids", "--enable-auto-tool-choice", "--tool-call-parser",
    "--max-num-seqs", "--max-num-batched-tokens", "--gpu-memory-utilization", "--kv-cache-memory-bytes",
    "--block-size", "--enable-prefix-caching", "--no-enable-prefix-caching", "--enable-chunked-prefill",
    "--no-enable-chunked-prefill", "--enforce-eager", "--tensor-parallel-size", "-tp", "--data-parallel-size",
    "-dp", "--dp-retry-on-failure", "--dp-max-restarts", "--weight-transfer-config", "--enable-lora",
    "--max-loras", "--max-cpu-loras", "--max-lora-rank", "--lora-modules", "--reject-while-asleep",
    "--enable-sleep-mode",
    "--disable-custom-all-reduce",
]


def _serve_actions() -> dict[str, object]:
    parser = build_parser()
    serve = parser._subparsers._group_actions[0].choices["serve"]
    return {opt: a for a in serve._actions for opt in a.option_strings}


def _config(*flags: str) -> EngineConfig:
    return config_from_args(build_parser().parse_args(["serve", "m", *flags]))


def test_every_flag_is_still_there_with_help():
    actions = _serve_actions()
    assert [f for f in FLAGS if f not in actions] == []
    assert [f for f, a in actions.items() if not a.help] == []
    text = subprocess.run([sys.executable, "-m", "rlserve.cli", "serve", "--help"], capture_output=True,
                          text=True, timeout=120, check=True).stdout
    assert [f for f in FLAGS if f not in text] == []


def test_each_engine_field_is_a_flag_or_says_why_not():
    actions = _serve_actions()
    for f in dataclasses.fields(EngineConfig):
        meta = f.metadata
        assert ("help" in meta) != ("no_flag" in meta), f"{f.name}: give it flag(...) or no_flag(...)"
        if "help" not in meta:
            continue
        action = actions[meta.get("name", "--" + f.name.replace("_", "-"))]
        assert action.dest == f.name and action.help.startswith(meta["help"])
        default = None if f.default is dataclasses.MISSING else f.default
        assert action.default == default, f.name


def test_the_defaults_are_the_engine_configs():
    cfg = _config()
    assert dataclasses.replace(cfg, model="m") == EngineConfig(model="m")


def test_flags_set_their_fields(tmp_path):
    template = tmp_path / "chat.jinja"
    template.write_text("{{ messages }}")
    cfg = _config(
        "--tokenizer", "t", "--device", "cpu", "--dtype", "bfloat16", "--load-format", "dummy",
        "--max-model-len", "512", "--seed", "3", "--trust-remote-code", "--block-size", "32",
        "--kv-cache-dtype", "fp8", "--no-enable-prefix-caching", "--gpu-memory-utilization", "0.5",
        "--kv-cache-memory-bytes", "2G",
        "--max-num-seqs", "8", "--max-num-batched-tokens", "1024", "--enforce-eager", "-tp", "1", "-dp", "1",
        "--dp-retry-on-failure", "--dp-max-restarts", "0", "--served-model-name", "x",
        "--chat-template", str(template), "--weight-transfer-config", '{"backend": "gloo", "timeout_s": 30}',
        "--logprobs-mode", "processed_logprobs", "--enable-lora", "--max-loras", "2", "--max-lora-rank", "8",
        "--lora-modules", "a=/p/a", json.dumps({"name": "b", "path": "/p/b"}))
    assert cfg == EngineConfig(
        model="m", tokenizer="t", device="cpu", dtype="bfloat16", load_format="dummy", max_model_len=512,
        seed=3, trust_remote_code=True, block_size=32, kv_cache_dtype="fp8",
        enable_prefix_caching=False, gpu_memory_utilization=0.5, kv_cache_memory_bytes=2 << 30, max_num_seqs=8,
        max_num_batched_tokens=1024,
        enforce_eager=True, dp_retry_on_failure=True, dp_max_restarts=0, served_model_name="x",
        chat_template="{{ messages }}", weight_transfer=WeightTransferConfig("gloo", 30.0),
        logprobs_mode="processed_logprobs", enable_lora=True, max_loras=2, max_lora_rank=8,
        lora_modules={"a": "/p/a", "b": "/p/b"})
    # Booleans also take vLLM's --no- form.
    assert not _config("--enforce-eager", "--no-enforce-eager").enforce_eager
    assert _config("--chat-template", "{{ inline }}").chat_template == "{{ inline }}"


def test_max_cpu_loras_defaults_to_max_loras_and_is_no_fewer():
    assert _config("--enable-lora", "--max-loras", "2").max_cpu_loras == 2
    assert _config("--enable-lora", "--max-loras", "2", "--max-cpu-loras", "5").max_cpu_loras == 5
    with pytest.raises(SystemExit) as e:  # as vLLM refuses it
        _config("--enable-lora", "--max-loras", "4", "--max-cpu-loras", "2")
    assert str(e.value) == "rlserve serve: max_cpu_loras (2) must be >= max_loras (4)"


@pytest.mark.parametrize("flags, message", [
    (["--max-model-len", "0"], "--max-model-len: must be at least 1, got 0"),
    (["--kv-cache-memory-bytes", "lots"], "--kv-cache-memory-bytes: not a byte size: 'lots'"),
    (["--lora-modules", "x"], "--lora-modules: not name=path: 'x'"),
    (["--block-size", "3"], "--block-size: invalid choice: 3"),
    (["--chat-template", "/no/such/file"], "--chat-template: no such file '/no/such/file'"),
    (["--dtype", "int8"], "--dtype: invalid choice: 'int8'"),
    (["--kv-cache-dtype", "int8"], "--kv-cache-dtype: invalid choice: 'int8'"),
    (["-dp", "0"], "--data-parallel-size/-dp: must be at least 1, got 0"),
])
def test_a_bad_flag_is_a_usage_error_naming_it(flags, message, capsys):
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["serve", "m", *flags])
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_a_bad_engine_setting_names_its_flag():
    with pytest.raises(SystemExit, match="weight-transfer-config: backend must be nccl, gloo or ipc"):
        _config("--weight-transfer-config", '{"backend": "x"}')
    with pytest.raises(SystemExit, match="--no-enable-chunked-prefill"):
        _config("--no-enable-chunked-prefill")


def test_help_lists_every_serve_option_with_the_fields_default():
    """ServeOptions is the one source of the server's flags, as EngineConfig is of the
    engine's: each field is a flag `rlserve serve --help` shows, or says why not."""
    actions = _serve_actions()
    text = subprocess.run([sys.executable, "-m", "rlserve.cli", "serve", "--help"], capture_output=True,
                          text=True, timeout=120, check=True).stdout
    fields = dataclasses.fields(ServeOptions)
    assert len(fields) > 15
    for f in fields:
        assert ("help" in f.metadata) != ("no_flag" in f.metadata), f"{f.name}: give it flag(...) or no_flag(...)"
        if "no_flag" in f.metadata:
            continue
        name = flag_name(f)
        assert re.search(rf"^ +{re.escape(name)}(?=[ ,]|$)", text, re.M), f"--help does not list {name}"
        assert actions[name].dest == f.name and actions[name].help.startswith(f.metadata["help"])
        assert actions[name].default == (None if f.default is dataclasses.MISSING else f.default), f.name
    args = build_parser().parse_args(["serve", "m"])
    assert ServeOptions(**flag_values(ServeOptions, args)) == ServeOptions()
    args = build_parser().parse_args(["serve", "m", "--port", "9", "--max-request-body-bytes", "1G",
                                      "--disable-uvicorn-access-log", "--shutdown-grace-period", "2.5"])
    assert ServeOptions(**flag_values(ServeOptions, args)) == ServeOptions(
        port=9, max_request_body_bytes=1 << 30, disable_uvicorn_access_log=True, shutdown_grace_period=2.5)
