"""ServeOptions: what `rlserve serve` takes beyond the engine's configuration. Each field
with `flag(...)` metadata is the flag of the same name (`--api-server-count` for
api_server_count), its type, default and help written here once (flags.py makes the
flags). A new server flag is a new field."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rlserve.flags import byte_size, flag, json_object, no_flag, port_number, positive_int
from rlserve.server.limits import DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_PROMPTS
from rlserve.server.tool_parsers import TOOL_PARSERS

_SERVER, _OUTPUTS = "server", "sampling defaults and outputs"
_KEPT_OUT = "which keep it out of the process list"


@dataclass
class ServeOptions:
    host: str = field(default="0.0.0.0", metadata=flag("address to bind", group=_SERVER))
    port: int = field(default=8000, metadata=flag("port to listen on", type=port_number, group=_SERVER))
    api_key: str | None = field(default=None, metadata=flag(
        "require 'Authorization: Bearer KEY'; also read from --api-key-file, VLLM_API_KEY or "
        f"RLSERVE_API_KEY, {_KEPT_OUT} (a flag's value is readable by every local user)", group=_SERVER))
    api_key_file: str | None = field(default=None, metadata=flag(
        "read --api-key from this file (its text, surrounding whitespace dropped)", metavar="PATH",
        group=_SERVER))
    admin_key: str | None = field(default=None, metadata=flag(
        "key for the weight-update control endpoints (without it they answer loopback clients "
        f"only); also read from --admin-key-file or RLSERVE_ADMIN_KEY, {_KEPT_OUT}", group=_SERVER))
    admin_key_file: str | None = field(default=None, metadata=flag(
        "read --admin-key from this file (its text, surrounding whitespace dropped)", metavar="PATH",
        group=_SERVER))
    allow_remote_control: bool = field(default=False, metadata=flag(
        "without --admin-key, open the control endpoints to every client instead of loopback "
        "ones only", group=_SERVER))
    log_level: str = field(default="info", metadata=flag(
        "rlserve's log level", choices=["debug", "info", "warning", "error"], group=_SERVER))
    disable_uvicorn_access_log: bool = field(default=False, metadata=flag(
        "no access log line per request", group=_SERVER))
    uvicorn_log_level: str | None = field(default=None, metadata=flag(
        "uvicorn's log level (access log included) (default: --log-level)",
        choices=["critical", "error", "warning", "info", "debug", "trace"], group=_SERVER))
    api_server_count: int = field(default=1, metadata=flag(
        "API server processes on the port (HTTP, tokenization and detokenization), all feeding "
        "the one engine process", type=positive_int, group=_SERVER))
    max_request_body_bytes: int = field(default=DEFAULT_MAX_BODY_BYTES, metadata=flag(
        "larger request bodies are refused with 413", type=byte_size, group=_SERVER))
    max_prompts_per_request: int = field(default=DEFAULT_MAX_PROMPTS, metadata=flag(
        "prompts in one /v1/completions request at most", type=positive_int, group=_SERVER))
    shutdown_grace_period: float = field(default=5.0, metadata=flag(
        "on SIGINT or SIGTERM, requests in flight may finish for this long; then they end with "
        "finish_reason 'abort'", metavar="SECONDS", group=_SERVER))
    engine_death_linger: float = field(default=5.0, metadata=flag(
        "after the engine dies, /health answers 503 for this long before the server exits with "
        "code 1", metavar="SECONDS", group=_SERVER))
    reject_while_asleep: bool = field(default=False, metadata=flag(
        "answer generation requests with 503 while /sleep is in effect (default: they wait for "
        "/wake_up)", group=_SERVER))
    root_path: str = field(default="", metadata=flag(
        "the path prefix a proxy in front serves this server under (FastAPI's root_path): "
        "requests may carry it or not, and the OpenAPI schema names it", metavar="PATH", group=_SERVER))
    enable_server_load_tracking: bool = field(default=False, metadata=flag(
        "count the generation requests in flight for GET /load (0 without this flag)", group=_SERVER))
    enable_tokenizer_info_endpoint: bool = field(default=False, metadata=flag(
        "GET /tokenizer_info: the tokenizer's class and configuration, chat template included",
        group=_SERVER))
    enable_sleep_mode: bool = field(default=False, metadata=flag(
        "POST /sleep, POST /wake_up and GET /is_sleeping without a weight-transfer backend "
        "(with one they always exist)", group=_SERVER))
    # How the API server fills in and writes out requests.
    generation_config: str = field(default="auto", metadata=flag(
        "sampling defaults for fields a request leaves unset: auto = the model's "
        "generation_config.json, vllm = none, PATH = the generation_config.json in that folder; "
        "its max_new_tokens caps max_tokens", metavar="auto|vllm|PATH", group=_OUTPUTS))
    override_generation_config: dict[str, Any] | None = field(default=None, metadata=flag(
        'laid over the generation config, e.g. \'{"temperature": 0.5}\'', type=json_object,
        metavar="JSON", group=_OUTPUTS))
    return_tokens_as_token_ids: bool = field(default=False, metadata=flag(
        "logprob tokens read 'token_id:<id>' unless a request says otherwise", group=_OUTPUTS))
    enable_force_include_usage: bool = field(default=False, metadata=flag(
        "every stream ends with a usage chunk, as if it asked for stream_options.include_usage",
        group=_OUTPUTS))
    tool_call_parser: str = field(default="hermes", metadata=flag(
        "how tool calls are read from the model's text (hermes: <tool_call>{...}</tool_call>, "
        "as Qwen writes them)", choices=sorted(TOOL_PARSERS), group=_OUTPUTS))
    generation_defaults: dict[str, Any] = field(default_factory=dict, metadata=no_flag(
        "what --generation-config and --override-generation-config make of the model's "
        "generation_config.json, read once by `rlserve serve` (generation_config.py)"))
