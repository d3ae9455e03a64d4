"""Command line: `rlserve serve [MODEL] [flags]`, with the flags of `vllm serve`."""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import sys
from typing import TYPE_CHECKING, Sequence

from rlserve import __version__
from rlserve.sampling_params import LOGPROBS_MODES, MAX_LOGPROBS
from rlserve.server.tool_parsers import TOOL_PARSERS

if TYPE_CHECKING:
    from rlserve.config import EngineConfig

logger = logging.getLogger("rlserve")

_SIZE_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def _byte_size(value: str) -> int:
    """`1073741824`, `1G`, `1GiB`, `512M`: powers of two, as memory is counted."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kKmMgGtT]?)(?:i?[bB])?\s*", value)
    if not m:
        raise argparse.ArgumentTypeError(f"not a byte size: {value!r} (try 2G or 2147483648)")
    return int(float(m.group(1)) * _SIZE_UNITS[m.group(2).lower()])


def _positive_int(value: str) -> int:
    n = int(value)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {n}")
    return n


def _key(env: str):
    """A key: never empty, which would look set but turn authentication off."""
    def parse(value: str) -> str:
        if not value.strip():
            raise argparse.ArgumentTypeError(
                f"the key is empty (an unset shell variable? {env} counts too); give a non-empty "
                f"key, or leave the flag out and {env} unset to serve without one")
        return value
    return parse


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows defaults, except the unset ones (None says nothing useful)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None:
            return action.help
        return super()._get_help_string(action)


def _add_serve_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve", help="serve a model over an OpenAI-compatible HTTP API",
        description="Serve MODEL (an HF directory or hub id; the bundled demo model, "
                    "SmolLM2-135M-Instruct, when omitted) over an OpenAI-compatible API.",
        formatter_class=_HelpFormatter)
    p.add_argument("model", nargs="?", default=None, metavar="MODEL",
                   help="model directory or hub id (default: the demo model)")
    net = p.add_argument_group("server")
    net.add_argument("--host", default="0.0.0.0", help="address to bind")
    net.add_argument("--port", type=int, default=8000)
    net.add_argument("--served-model-name", default=None,
                     help="name clients use in `model` (default: MODEL)")
    # A string default goes through `type` too: an empty variable is refused as the flag is.
    net.add_argument("--api-key", type=_key("RLSERVE_API_KEY"), default=os.environ.get("RLSERVE_API_KEY"),
                     help="require 'Authorization: Bearer KEY' (or set RLSERVE_API_KEY)")
    net.add_argument("--admin-key", type=_key("RLSERVE_ADMIN_KEY"), default=os.environ.get("RLSERVE_ADMIN_KEY"),
                     help="key for the weight-update control endpoints (or RLSERVE_ADMIN_KEY); "
                          "without it they answer loopback clients only")
    net.add_argument("--allow-remote-control", action="store_true",
                     help="without --admin-key, open the control endpoints to every client "
                          "instead of loopback ones only")
    net.add_argument("--chat-template", default=None,
                     help="Jinja chat template, as a file path or inline "
                          "(default: the tokenizer's)")
    net.add_argument("--log-level", default="info",
                     choices=["debug", "info", "warning", "error"])
    net.add_argument("--uvicorn-log-level", default=None,
                     choices=["critical", "error", "warning", "info", "debug", "trace"],
                     help="uvicorn's log level (access log included) (default: --log-level)")
    net.add_argument("--disable-log-requests", action="store_true",
                     help="accepted for vllm serve command lines: rlserve does not log requests")
    net.add_argument("--disable-log-stats", action="store_true",
                     help="accepted for vllm serve command lines: rlserve does not log periodic "
                          "stats (see /metrics)")
    net.add_argument("--api-server-count", type=_positive_int, default=1,
                     help="API server processes on the port (HTTP, tokenization and "
                          "detokenization), all feeding the one engine process")
    net.add_argument("--max-request-body-bytes", type=_byte_size, default="64M",
                     help="larger request bodies are refused with 413")
    net.add_argument("--max-prompts-per-request", type=_positive_int, default=2048,
                     help="prompts in one /v1/completions request at most")
    net.add_argument("--shutdown-grace-period", type=float, default=5.0, metavar="SECONDS",
                     help="on SIGINT or SIGTERM, requests in flight may finish for this long; "
                          "then they end with finish_reason 'abort'")
    net.add_argument("--engine-death-linger", type=float, default=5.0, metavar="SECONDS",
                     help="after the engine dies, /health answers 503 for this long before the "
                          "server exits with code 1")

    model = p.add_argument_group("model")
    model.add_argument("--tokenizer", default=None, help="tokenizer directory (default: MODEL)")
    model.add_argument("--device", default="auto",
                       help="cpu, cuda, cuda:1 ... (auto: cuda if present)")
    model.add_argument("--dtype", default="auto",
                       choices=["auto", "float32", "float", "bfloat16", "float16", "half"])
    model.add_argument("--load-format", default="auto",
                       choices=["auto", "dummy", "safetensors", "pt"],
                       help="dummy: random weights, for a trainer to overwrite")
    model.add_argument("--max-model-len", type=_positive_int, default=None,
                       help="prompt + output token limit (default: the model's)")
    model.add_argument("--seed", type=int, default=0)
    model.add_argument("--trust-remote-code", action="store_true")

    sampling = p.add_argument_group("sampling defaults and outputs")
    sampling.add_argument("--generation-config", default="auto", metavar="auto|vllm|PATH",
                          help="sampling defaults for fields a request leaves unset: auto = the "
                               "model's generation_config.json, vllm = none, PATH = the "
                               "generation_config.json in that folder; its max_new_tokens caps "
                               "max_tokens")
    sampling.add_argument("--override-generation-config", type=_json_object, default=None,
                          metavar="JSON", help='laid over the generation config, e.g. '
                                               '\'{"temperature": 0.5}\'')
    sampling.add_argument("--logprobs-mode", default="raw_logprobs", choices=LOGPROBS_MODES,
                          help="raw: of the model's logits (what RL importance ratios need); "
                               "processed: of the logits sampled from (after bias, masks, "
                               "penalties, temperature, top-k/p, min-p)")
    sampling.add_argument("--max-logprobs", type=int, default=MAX_LOGPROBS,
                          choices=range(MAX_LOGPROBS + 1),
                          metavar=f"0..{MAX_LOGPROBS}",
                          help="most logprobs, top_logprobs or prompt_logprobs a request may ask for")
    sampling.add_argument("--return-tokens-as-token-ids", action="store_true",
                          help="logprob tokens read 'token_id:<id>' unless a request says otherwise")
    sampling.add_argument("--enable-auto-tool-choice", action="store_true",
                          help="accepted for vllm serve command lines: tool_choice auto is always on")
    sampling.add_argument("--tool-call-parser", default="hermes", choices=sorted(TOOL_PARSERS),
                          help="how tool calls are read from the model's text (hermes: "
                               "<tool_call>{...}</tool_call>, as Qwen writes them)")

    cache = p.add_argument_group("cache and scheduling")
    cache.add_argument("--max-num-seqs", type=_positive_int, default=256,
                       help="sequences in one batch at most")
    cache.add_argument("--max-num-batched-tokens", type=_positive_int, default=8192,
                       help="tokens in one step at most (prefill chunks + decodes)")
    cache.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                       help="fraction of GPU memory for weights, activations and KV cache")
    cache.add_argument("--kv-cache-memory-bytes", type=_byte_size, default=None,
                       help="explicit KV cache budget, e.g. 2G (overrides the utilization)")
    cache.add_argument("--block-size", type=int, default=16, choices=[8, 16, 32, 64, 128])
    cache.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                       default=True, help="reuse the KV cache of shared prompt prefixes")
    cache.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction,
                       default=True, help="long prompts are always prefilled in chunks (the "
                                          "--no- form is refused)")

    run = p.add_argument_group("execution")
    run.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    run.add_argument("--tensor-parallel-size", "-tp", type=_positive_int, default=1)
    run.add_argument("--data-parallel-size", "-dp", type=_positive_int, default=1,
                     help="engine replicas behind the one endpoint, each of "
                          "--tensor-parallel-size devices (replica i: GPUs i*TP..(i+1)*TP-1)")
    run.add_argument("--dp-retry-on-failure", action="store_true",
                     help="data parallel: when a replica dies, run its requests that have "
                          "produced no token yet again on another replica (else they fail with 503)")
    run.add_argument("--dp-max-restarts", type=int, default=3, metavar="N",
                     help="data parallel: restart a replica that died at most N times; it serves "
                          "again once it has copied the current weights from a healthy replica")
    run.add_argument("--weight-transfer-config", default=None, metavar="JSON",
                     help='enable live weight updates, e.g. \'{"backend": "nccl"}\' '
                          "(backends: nccl, gloo, ipc)")
    lora = p.add_argument_group("LoRA adapters")
    lora.add_argument("--enable-lora", action="store_true",
                      help="serve LoRA adapters (PEFT format), chosen per request by `model`")
    lora.add_argument("--max-loras", type=_positive_int, default=1,
                      help="adapters loaded at once (their slots are allocated at start)")
    lora.add_argument("--max-lora-rank", type=_positive_int, default=16,
                      help="the largest adapter rank served")
    lora.add_argument("--lora-modules", nargs="+", type=_lora_module, default=None, metavar="NAME=PATH",
                      help='adapters loaded at start: name=path, or JSON {"name": ..., "path": ...}')
    run.add_argument("--reject-while-asleep", action="store_true",
                     help="answer generation requests with 503 while /sleep is in effect "
                          "(default: they wait for /wake_up)")
    run.add_argument("--enable-sleep-mode", action="store_true",
                     help="POST /sleep, POST /wake_up and GET /is_sleeping without a "
                          "weight-transfer backend (with one they always exist)")
    run.add_argument("--disable-custom-all-reduce", action="store_true",
                     help="accepted for vllm serve command lines: rlserve has no custom all-reduce")
    p.set_defaults(func=serve)


def _lora_module(value: str) -> tuple[str, str]:
    """`name=path` or vLLM's JSON form `{"name": ..., "path": ...}`."""
    if value.lstrip().startswith("{"):
        try:
            data = json.loads(value)
            return str(data["name"]), str(data["path"])
        except (ValueError, KeyError, TypeError) as e:
            raise argparse.ArgumentTypeError(f'not {{"name": ..., "path": ...}}: {value!r} ({e})')
    name, sep, path = value.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"not name=path: {value!r}")
    return name, path


def _json_object(value: str) -> dict:
    try:
        data = json.loads(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return data


def _read_chat_template(value: str | None) -> str | None:
    if value is None:
        return None
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            return f.read()
    if "{" not in value:  # a path that does not exist, most likely
        raise SystemExit(f"--chat-template: no such file {value!r}")
    return value


def _dp_engines(size: int) -> list[dict[str, str]] | None:
    """RLSERVE_DP_ENGINES (JSON, set by rlserve.ray): replicas started elsewhere, each
    {"input": ..., "output": ...}, that this server attaches to instead of starting them."""
    value = os.environ.get("RLSERVE_DP_ENGINES")
    if not value:
        return None
    import json
    engines = json.loads(value)
    if not (isinstance(engines, list) and all(isinstance(e, dict) and set(e) == {"input", "output"}
                                              for e in engines)):
        raise SystemExit('RLSERVE_DP_ENGINES: must be a JSON list of {"input": ..., "output": ...}')
    return engines


def config_from_args(args: argparse.Namespace) -> "EngineConfig":
    """The engine configuration `rlserve serve` flags describe (SystemExit naming the flag
    when one is wrong). rlserve.ray builds its replicas' configuration with it too."""
    from rlserve.config import EngineConfig, WeightTransferConfig

    if not args.enable_chunked_prefill:
        raise SystemExit("rlserve serve: --no-enable-chunked-prefill: prompts are always prefilled "
                         "in chunks of --max-num-batched-tokens; raise that instead")
    model, served_name = args.model, args.served_model_name
    if model is None:
        from rlserve.model.demo_model import DEMO_MODEL_NAME, demo_model_path
        model = demo_model_path()
        served_name = served_name or DEMO_MODEL_NAME  # not the cache path it lives at
        logger.info("no MODEL given: serving the demo model %s from %s", served_name, model)
    try:
        config = EngineConfig(
            model=model, tokenizer=args.tokenizer, device=args.device, dtype=args.dtype,
            load_format=args.load_format, seed=args.seed, max_model_len=args.max_model_len,
            block_size=args.block_size, enable_prefix_caching=args.enable_prefix_caching,
            gpu_memory_utilization=args.gpu_memory_utilization,
            kv_cache_memory_bytes=args.kv_cache_memory_bytes, max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            enforce_eager=args.enforce_eager, tensor_parallel_size=args.tensor_parallel_size,
            data_parallel_size=args.data_parallel_size, dp_retry_on_failure=args.dp_retry_on_failure,
            dp_max_restarts=args.dp_max_restarts, dp_engines=_dp_engines(args.data_parallel_size),
            served_model_name=served_name,
            chat_template=_read_chat_template(args.chat_template),
            weight_transfer=WeightTransferConfig.parse(args.weight_transfer_config),
            trust_remote_code=args.trust_remote_code, logprobs_mode=args.logprobs_mode,
            enable_lora=args.enable_lora, max_loras=args.max_loras, max_lora_rank=args.max_lora_rank,
            lora_modules=dict(args.lora_modules or []))
    except ValueError as e:  # config errors name the flag; no traceback for a typo
        raise SystemExit(f"rlserve serve: {e}") from None
    if config.data_parallel_size > 1 and args.api_server_count > 1:
        raise SystemExit("rlserve serve: --api-server-count above 1 with --data-parallel-size "
                         "above 1 is not supported yet: use one API server")
    return config


def serve(args: argparse.Namespace) -> int:
    from rlserve.model.loader import resolve_model_path
    from rlserve.server import lifecycle
    from rlserve.server.generation_config import generation_defaults

    config = config_from_args(args)
    try:
        defaults = generation_defaults(
            args.generation_config,
            resolve_model_path(config.model) if args.generation_config == "auto" else None,
            args.override_generation_config)
    except ValueError as e:
        raise SystemExit(f"rlserve serve: {e}") from None

    if config.weight_transfer is not None:
        from rlserve.server.security import describe_control_access
        logger.info("weight transfer: %s backend; control endpoints %s", config.weight_transfer.backend,
                    describe_control_access(args.admin_key, args.allow_remote_control))
    return lifecycle.serve(config, lifecycle.ServeOptions(
        host=args.host, port=args.port, api_key=args.api_key, admin_key=args.admin_key,
        allow_remote_control=args.allow_remote_control,
        reject_while_asleep=args.reject_while_asleep, max_body_bytes=args.max_request_body_bytes,
        max_prompts=args.max_prompts_per_request, log_level=args.log_level,
        grace_s=args.shutdown_grace_period, linger_s=args.engine_death_linger,
        api_server_count=args.api_server_count, uvicorn_log_level=args.uvicorn_log_level,
        enable_sleep_mode=args.enable_sleep_mode, generation_defaults=defaults,
        max_logprobs=args.max_logprobs, return_tokens_as_token_ids=args.return_tokens_as_token_ids,
        tool_call_parser=args.tool_call_parser))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rlserve", description="A rollout server for RL post-training.")
    parser.add_argument("--version", action="version", version=f"rlserve {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    _add_serve_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    logging.basicConfig(
        level=getattr(logging, getattr(args, "log_level", "info").upper()),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
