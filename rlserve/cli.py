"""Command line: `rlserve serve [MODEL] [flags]`, with the flags of `vllm serve`."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
from typing import Sequence

from rlserve import __version__, envs
from rlserve.config import EngineConfig, byte_size, positive_int
from rlserve.sampling_params import MAX_LOGPROBS
from rlserve.server.tool_parsers import TOOL_PARSERS

logger = logging.getLogger("rlserve")


# Where each key may come from, first found wins: the flag, the file flag, the variables.
_KEY_SOURCES = {"api_key": ("--api-key", "--api-key-file", (envs.VLLM_API_KEY, envs.RLSERVE_API_KEY)),
                "admin_key": ("--admin-key", "--admin-key-file", (envs.RLSERVE_ADMIN_KEY,))}


def _resolve_key(args: argparse.Namespace, dest: str, error) -> tuple[str | None, str | None]:
    """(key, where it came from) for `dest`; `error` (the parser's) for an empty or unreadable
    one: an empty key would look set but turn authentication off."""
    flag, file_flag, variables = _KEY_SOURCES[dest]
    value, path = getattr(args, dest), getattr(args, dest + "_file")
    if value is not None and path is not None:
        error(f"{flag} and {file_flag}: give one of them")
    source = flag if value is not None else None
    if path is not None:
        try:
            with open(path, encoding="utf-8") as f:
                value, source = f.read().strip(), f"{file_flag} {path}"
        except OSError as e:
            error(f"{file_flag}: cannot read {path}: {e.strerror}")
    for var in variables if source is None else ():
        if (text := var.raw()) is not None:
            value, source = text, var.name
            break
    if source is not None and not value.strip():
        error(f"{flag}: the key is empty (from {source}; an unset shell variable?); give a "
              f"non-empty key, or leave {flag}, {file_flag} and {', '.join(v.name for v in variables)} "
              "unset to serve without one")
    return value, source


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows defaults, except the unset ones (None says nothing useful)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None:
            return action.help
        return super()._get_help_string(action)


def _arg_type(parse):
    """An argparse type from a parser that raises ValueError: its message in the usage error."""
    def convert(value: str):
        try:
            return parse(value)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    convert.__name__ = parse.__name__  # argparse names it in "invalid <name> value"
    return convert


def port_number(value: str) -> int:
    if not value.strip().isdigit():
        raise ValueError(f"not a port number: {value!r}")
    n = int(value)
    if not 0 <= n <= 65535:
        raise ValueError(f"must be in 0..65535, got {n}")
    return n


_GROUPS = ("server", "model", "sampling defaults and outputs", "cache and scheduling", "execution",
           "LoRA adapters")


def _add_serve_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve", help="serve a model over an OpenAI-compatible HTTP API",
        description="Serve MODEL (an HF directory or hub id; the bundled demo model, "
                    "SmolLM2-135M-Instruct, when omitted) over an OpenAI-compatible API.",
        formatter_class=_HelpFormatter)
    p.usage = "rlserve serve [MODEL] [flags]  (rlserve serve --help lists them)"
    p.add_argument("model", nargs="?", default=None, metavar="MODEL",
                   help="model directory or hub id (default: the demo model)")
    groups = {title: p.add_argument_group(title) for title in _GROUPS}
    _add_server_flags(groups["server"])
    _add_output_flags(groups["sampling defaults and outputs"])
    _add_engine_flags(groups)
    _add_vllm_flags(groups["execution"])
    p.set_defaults(func=serve)


def _field_type(annotation: str) -> type:
    """The command-line type of a field annotated `annotation` (a string: the module has
    postponed annotations): the first of bool, int, float, str it names."""
    names = {part.strip() for part in annotation.split("|")}
    return next(t for t in (bool, int, float, str) if t.__name__ in names)


def _add_engine_flags(groups: dict[str, argparse._ArgumentGroup]) -> None:
    """A flag per EngineConfig field with flag(...) metadata: vLLM's name (--max-model-len
    for max_model_len), the field's default and help, a bool as --flag / --no-flag."""
    for f in dataclasses.fields(EngineConfig):
        if "help" not in f.metadata:
            continue
        options = dict(f.metadata)
        group = groups[options.pop("group")]
        names = [options.pop("name", "--" + f.name.replace("_", "-")), *options.pop("aliases", ())]
        default = None if f.default is dataclasses.MISSING else f.default
        kind = options.pop("type", None) or _field_type(f.type)
        if kind is bool:
            options["action"] = argparse.BooleanOptionalAction
        else:
            options["type"] = kind if kind in (int, float, str) else _arg_type(kind)
        group.add_argument(*names, dest=f.name, default=default, **options)


def engine_flag_values(args: argparse.Namespace) -> dict[str, object]:
    """The EngineConfig fields the flags set (those left unset keep the field's default)."""
    return {f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig)
            if "help" in f.metadata and getattr(args, f.name) is not None}


def _add_server_flags(net: argparse._ArgumentGroup) -> None:
    """The API server's own flags (lifecycle.ServeOptions)."""
    net.add_argument("--host", default="0.0.0.0", help="address to bind")
    net.add_argument("--port", type=_arg_type(port_number), default=8000, help="port to listen on")
    net.add_argument("--api-key", default=None,
                     help="require 'Authorization: Bearer KEY'; also read from --api-key-file, "
                          "VLLM_API_KEY or RLSERVE_API_KEY, which keep it out of the process list "
                          "(a flag's value is readable by every local user)")
    net.add_argument("--api-key-file", default=None, metavar="PATH",
                     help="read --api-key from this file (its text, surrounding whitespace dropped)")
    net.add_argument("--admin-key", default=None,
                     help="key for the weight-update control endpoints (without it they answer "
                          "loopback clients only); also read from --admin-key-file or "
                          "RLSERVE_ADMIN_KEY, which keep it out of the process list")
    net.add_argument("--admin-key-file", default=None, metavar="PATH",
                     help="read --admin-key from this file (its text, surrounding whitespace dropped)")
    net.add_argument("--allow-remote-control", action="store_true",
                     help="without --admin-key, open the control endpoints to every client "
                          "instead of loopback ones only")
    net.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                     help="rlserve's log level")
    net.add_argument("--disable-uvicorn-access-log", action="store_true",
                     help="no access log line per request")
    net.add_argument("--uvicorn-log-level", default=None,
                     choices=["critical", "error", "warning", "info", "debug", "trace"],
                     help="uvicorn's log level (access log included) (default: --log-level)")
    net.add_argument("--api-server-count", type=_arg_type(positive_int), default=1,
                     help="API server processes on the port (HTTP, tokenization and "
                          "detokenization), all feeding the one engine process")
    net.add_argument("--max-request-body-bytes", type=_arg_type(byte_size), default="64M",
                     help="larger request bodies are refused with 413")
    net.add_argument("--max-prompts-per-request", type=_arg_type(positive_int), default=2048,
                     help="prompts in one /v1/completions request at most")
    net.add_argument("--shutdown-grace-period", type=float, default=5.0, metavar="SECONDS",
                     help="on SIGINT or SIGTERM, requests in flight may finish for this long; "
                          "then they end with finish_reason 'abort'")
    net.add_argument("--engine-death-linger", type=float, default=5.0, metavar="SECONDS",
                     help="after the engine dies, /health answers 503 for this long before the "
                          "server exits with code 1")
    net.add_argument("--reject-while-asleep", action="store_true",
                     help="answer generation requests with 503 while /sleep is in effect "
                          "(default: they wait for /wake_up)")
    net.add_argument("--enable-sleep-mode", action="store_true",
                     help="POST /sleep, POST /wake_up and GET /is_sleeping without a "
                          "weight-transfer backend (with one they always exist)")


def _add_output_flags(sampling: argparse._ArgumentGroup) -> None:
    """How the API server fills in and writes out requests (lifecycle.ServeOptions)."""
    sampling.add_argument("--generation-config", default="auto", metavar="auto|vllm|PATH",
                          help="sampling defaults for fields a request leaves unset: auto = the "
                               "model's generation_config.json, vllm = none, PATH = the "
                               "generation_config.json in that folder; its max_new_tokens caps "
                               "max_tokens")
    sampling.add_argument("--override-generation-config", type=_json_object, default=None,
                          metavar="JSON", help='laid over the generation config, e.g. '
                                               '\'{"temperature": 0.5}\'')
    sampling.add_argument("--max-logprobs", type=int, default=MAX_LOGPROBS,
                          choices=range(MAX_LOGPROBS + 1),
                          metavar=f"0..{MAX_LOGPROBS}",
                          help="most logprobs, top_logprobs or prompt_logprobs a request may ask for")
    sampling.add_argument("--return-tokens-as-token-ids", action="store_true",
                          help="logprob tokens read 'token_id:<id>' unless a request says otherwise")
    sampling.add_argument("--tool-call-parser", default="hermes", choices=sorted(TOOL_PARSERS),
                          help="how tool calls are read from the model's text (hermes: "
                               "<tool_call>{...}</tool_call>, as Qwen writes them)")


# `vllm serve` flags accepted so its command lines run, with nothing to do here: (flag,
# argparse options, the values accepted (None: any), why nothing is done). A value outside
# those accepted is refused, naming the flag.
_VLLM_NO_OPS = (
    ("--disable-log-requests", {"action": "store_true"}, None, "rlserve does not log requests"),
    ("--enable-log-requests", {"action": "store_true"}, None, "rlserve does not log requests"),
    ("--disable-log-stats", {"action": "store_true"}, None, "rlserve does not log periodic stats (see /metrics)"),
    ("--enable-auto-tool-choice", {"action": "store_true"}, None, "tool_choice auto is always on"),
    ("--disable-custom-all-reduce", {"action": "store_true"}, None, "rlserve has no custom all-reduce"),
    ("--swap-space", {"type": float, "metavar": "GiB"}, None,
     "a preempted request is recomputed, never swapped to host memory"),
    ("--max-seq-len-to-capture", {"type": int, "metavar": "N"}, None,
     "CUDA graphs cover every batch up to --max-num-seqs at any length"),
    ("--tokenizer-mode", {"metavar": "auto"}, ("auto", "hf"), "the tokenizer loads with transformers' AutoTokenizer"),
    ("--distributed-executor-backend", {"metavar": "mp"}, ("mp",),
     "tensor-parallel ranks are local processes (for Ray, see rlserve.ray)"),
    ("--pipeline-parallel-size", {"type": int, "metavar": "1", "aliases": ("-pp",)}, (1,),
     "rlserve has no pipeline parallelism; use --tensor-parallel-size"),
)
# `vllm serve` flags refused by name: what to use instead.
_VLLM_REFUSED = (("--quantization", "-q", "quantized weights are not served yet: weights are "
                  "--dtype; an fp8 KV cache is --kv-cache-dtype fp8"),)


def _add_vllm_flags(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction,
                       default=True, help="long prompts are always prefilled in chunks (the "
                                          "--no- form is refused)")
    for name, options, accepted, why in _VLLM_NO_OPS:
        options = dict(options)
        shown = f" (only {', '.join(map(str, accepted))})" if accepted else ""
        group.add_argument(name, *options.pop("aliases", ()), default=None, **options,
                           help=f"accepted for vllm serve command lines{shown}: {why}")
    for name, alias, why in _VLLM_REFUSED:
        group.add_argument(name, alias, default=None, metavar="METHOD", help=f"refused: {why}")
    group.add_argument("--revision", default=None, help="the hub revision of MODEL to download")
    group.add_argument("--download-dir", default=None, metavar="DIR",
                       help="where MODEL is downloaded from the hub (default: the hub's cache)")


def _check_vllm_flags(args: argparse.Namespace) -> None:
    """One log line per accepted no-op flag given; SystemExit naming a refused one."""
    for name, _, accepted, why in _VLLM_NO_OPS:
        value = getattr(args, name[2:].replace("-", "_"))
        if value is None or value is False:
            continue
        if accepted is not None and value not in accepted:
            raise SystemExit(f"rlserve serve: {name} {value}: only {', '.join(map(str, accepted))} "
                             f"is supported ({why})")
        logger.info("%s: accepted, nothing to do: %s", name, why)
    for name, _, why in _VLLM_REFUSED:
        if getattr(args, name[2:]) is not None:
            raise SystemExit(f"rlserve serve: {name} {getattr(args, name[2:])}: {why}")


def _json_object(value: str) -> dict:
    try:
        data = json.loads(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return data


def _download(model: str, revision: str | None, download_dir: str | None) -> str:
    """The local directory of MODEL at `revision`, downloaded into `download_dir`."""
    from rlserve.model.loader import resolve_model_path
    if os.path.isdir(model):
        logger.info("--revision, --download-dir: MODEL is a local directory, nothing to download")
        return model
    try:
        return resolve_model_path(model, revision=revision, cache_dir=download_dir)
    except ValueError as e:
        raise SystemExit(f"rlserve serve: {e}") from None


def config_from_args(args: argparse.Namespace) -> EngineConfig:
    """The engine configuration `rlserve serve` flags describe (SystemExit naming the flag
    when one is wrong). rlserve.ray builds its replicas' configuration with it too."""
    _check_vllm_flags(args)
    if not args.enable_chunked_prefill:
        raise SystemExit("rlserve serve: --no-enable-chunked-prefill: prompts are always prefilled "
                         "in chunks of --max-num-batched-tokens; raise that instead")
    model, served_name = args.model, args.served_model_name
    if model is not None and (args.revision or args.download_dir):
        model, served_name = _download(model, args.revision, args.download_dir), served_name or model
    if model is None:
        from rlserve.model.demo_model import DEMO_MODEL_NAME, demo_model_path
        model = demo_model_path()
        served_name = served_name or DEMO_MODEL_NAME  # not the cache path it lives at
        logger.info("no MODEL given: serving the demo model %s from %s", served_name, model)
    try:
        config = EngineConfig(**{**engine_flag_values(args), "model": model, "served_model_name": served_name,
                                 "dp_engines": envs.RLSERVE_DP_ENGINES.get()})
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

    for dest in ("api_key", "admin_key"):
        if getattr(args, dest + "_source", None):  # which one, never the key
            logger.info("%s: from %s", dest.replace("_", " "), getattr(args, dest + "_source"))
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
        access_log=not args.disable_uvicorn_access_log,
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
    args, unknown = parser.parse_known_args(argv)
    if not getattr(args, "func", None):
        if unknown:
            parser.error(f"unrecognized arguments: {' '.join(unknown)}")
        parser.print_help()
        return 2
    serve_parser = parser._subparsers._group_actions[0].choices["serve"]
    if unknown:  # `rlserve serve`'s usage, not the top level's
        serve_parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    for dest in ("api_key", "admin_key"):
        key, source = _resolve_key(args, dest, serve_parser.error)
        setattr(args, dest, key)
        setattr(args, dest + "_source", source)
    logging.basicConfig(
        level=getattr(logging, getattr(args, "log_level", "info").upper()),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
