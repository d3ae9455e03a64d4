"""Copied `vllm serve` command lines run: vLLM's flags that have nothing to do here are
accepted with one log line, the ones rlserve cannot honour are refused by name in one line,
usage errors show `rlserve serve`'s usage, and keys can stay out of the process list."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import httpx
import pytest

from helpers.servers import start_tiny_server, stop_server
from rlserve.cli import _resolve_key, build_parser, config_from_args

NO_OPS = ["--swap-space", "4", "--disable-uvicorn-access-log", "--max-seq-len-to-capture", "8192",
          "--tokenizer-mode", "auto", "--distributed-executor-backend", "mp",
          "--pipeline-parallel-size", "1", "--enable-log-requests"]


def _cli(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if not k.endswith("_API_KEY")} | (env or {})
    return subprocess.run([sys.executable, "-m", "rlserve.cli", *argv], capture_output=True, text=True,
                          timeout=120, env=environ)


def test_vllm_flags_with_nothing_to_do_are_accepted_with_one_log_line_each(caplog, tmp_path):
    args = build_parser().parse_args(["serve", str(tmp_path), *NO_OPS, "--revision", "main",
                                      "--download-dir", str(tmp_path / "d")])
    with caplog.at_level(logging.INFO, logger="rlserve"):
        config_from_args(args)
    lines = [r.getMessage() for r in caplog.records if "nothing to do" in r.getMessage()]
    named = {line.split(":")[0] for line in lines}
    assert named == {"--swap-space", "--max-seq-len-to-capture", "--tokenizer-mode",
                     "--distributed-executor-backend", "--pipeline-parallel-size", "--enable-log-requests",
                     "--revision, --download-dir"}


@pytest.mark.parametrize("flags, message", [
    (["--quantization", "fp8"], "rlserve serve: --quantization fp8: quantized weights are not served yet"),
    (["-q", "awq"], "rlserve serve: --quantization awq:"),
    (["--pipeline-parallel-size", "2"], "--pipeline-parallel-size 2: only 1 is supported"),
    (["-pp", "4"], "--pipeline-parallel-size 4: only 1 is supported"),
    (["--tokenizer-mode", "mistral"], "--tokenizer-mode mistral: only auto, hf"),
    (["--distributed-executor-backend", "ray"], "--distributed-executor-backend ray: only mp"),
])
def test_vllm_flags_rlserve_cannot_honour_are_refused_by_name(flags, message):
    with pytest.raises(SystemExit) as e:
        config_from_args(build_parser().parse_args(["serve", "m", *flags]))
    assert message in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("argv, message", [
    (["serve", "--bogus-flag"], "unrecognized arguments: --bogus-flag"),
    (["serve", "--port", "99999"], "--port: must be in 0..65535, got 99999"),
    (["serve", "--port", "http"], "--port: not a port number: 'http'"),
])
def test_usage_errors_show_serves_usage_in_two_lines(argv, message):
    r = _cli(*argv)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 2 and lines[0].startswith("usage: rlserve serve"), r.stderr
    assert message in lines[1] and "Traceback" not in r.stderr


def test_a_cpu_server_refuses_nccl_at_start_up_in_one_line():
    r = _cli("serve", "--device", "cpu", "--weight-transfer-config", '{"backend": "nccl"}')
    assert r.returncode != 0
    assert r.stderr.strip().splitlines()[-1] == (
        "rlserve serve: weight-transfer-config: backend nccl needs a CUDA device, this server runs "
        "on cpu (use gloo)")
    assert "Traceback" not in r.stderr


def _keys(*argv: str, env: dict[str, str] | None = None):
    args = build_parser().parse_args(["serve", *argv])

    def error(message: str):
        raise SystemExit(message)

    saved = dict(os.environ)
    os.environ.update(env or {})
    try:
        return [_resolve_key(args, dest, error) for dest in ("api_key", "admin_key")]
    finally:
        os.environ.clear()
        os.environ.update(saved)


def test_keys_come_from_flags_files_or_the_environment(tmp_path, monkeypatch):
    for name in ("VLLM_API_KEY", "RLSERVE_API_KEY", "RLSERVE_ADMIN_KEY"):
        monkeypatch.delenv(name, raising=False)
    (tmp_path / "api").write_text("file-key\n")
    (tmp_path / "admin").write_text("admin-file-key\n")
    assert _keys() == [(None, None), (None, None)]
    assert _keys("--api-key-file", str(tmp_path / "api"), "--admin-key-file", str(tmp_path / "admin")) == [
        ("file-key", f"--api-key-file {tmp_path / 'api'}"),
        ("admin-file-key", f"--admin-key-file {tmp_path / 'admin'}")]
    assert _keys(env={"VLLM_API_KEY": "v", "RLSERVE_API_KEY": "r", "RLSERVE_ADMIN_KEY": "a"}) == [
        ("v", "VLLM_API_KEY"), ("a", "RLSERVE_ADMIN_KEY")]
    assert _keys("--api-key", "flag", env={"VLLM_API_KEY": "v"})[0] == ("flag", "--api-key")
    with pytest.raises(SystemExit, match="--api-key and --api-key-file: give one of them"):
        _keys("--api-key", "x", "--api-key-file", str(tmp_path / "api"))
    with pytest.raises(SystemExit, match="--admin-key-file: cannot read"):
        _keys("--admin-key-file", str(tmp_path / "missing"))
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(SystemExit, match="--api-key: the key is empty"):
        _keys("--api-key-file", str(tmp_path / "empty"))


def test_help_says_how_to_keep_keys_out_of_the_process_list():
    text = " ".join(_cli("serve", "--help").stdout.split())
    assert "VLLM_API_KEY" in text and "--api-key-file" in text and "--admin-key-file" in text
    assert text.count("keep it out of the process list") == 2


def test_a_copied_command_line_serves_without_a_tokenizer(tmp_path):
    """vLLM's flags end to end, with --skip-tokenizer-init (token ids in and out) and the
    API key from a file."""
    (tmp_path / "key").write_text("k-from-file\n")
    srv = start_tiny_server(tmp_path / "server.log", *NO_OPS, "--skip-tokenizer-init",
                            "--api-key-file", str(tmp_path / "key"))
    srv.api_key = "k-from-file"
    try:
        url, headers = f"{srv.url}/v1/completions", srv.headers
        r = httpx.post(url, json={"model": "m", "prompt": [1, 2, 3], "max_tokens": 3}, headers=headers, timeout=60)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["text"] == "" and r.json()["usage"]["completion_tokens"] == 3
        r = httpx.post(url, json={"model": "m", "prompt": "hi", "max_tokens": 3}, headers=headers, timeout=60)
        assert r.status_code == 400 and "--skip-tokenizer-init" in r.json()["error"]["message"]
        assert httpx.post(url, json={"model": "m", "prompt": [1], "max_tokens": 1}, timeout=60).status_code == 401
    finally:
        stop_server(srv, wait=True)
    log = srv.log.read_text()
    assert "POST /v1/completions" not in log  # --disable-uvicorn-access-log
    assert "--swap-space: accepted, nothing to do" in log
    assert "api key: from --api-key-file" in log and "k-from-file" not in log
