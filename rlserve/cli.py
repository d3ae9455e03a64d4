"""Command line: `rlserve serve [MODEL] [flags]`, with the flags of `vllm serve`."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence
from typing import Any

from rlserve import envs
from rlserve.config import EngineConfig
from rlserve.flags import HelpFormatter, add_flags, flag_values
from rlserve.server.options import ServeOptions
from rlserve.version import __version__

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


_GROUPS = ("server", "model", "sampling defaults and outputs", "cache and scheduling", "execution",
           "LoRA adapters")


def _add_serve_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve", help="serve a model over an OpenAI-compatible HTTP API",
        description="Serve MODEL (an HF directory or hub id; the bundled demo model, "
                    "SmolLM2-135M-Instruct, when omitted) over an OpenAI-compatible API.",
        formatter_class=HelpFormatter)
    p.usage = "rlserve serve [MODEL] [flags]  (rlserve serve --help lists them)"
    p.add_argument("model", nargs="?", default=None, metavar="MODEL",
                   help="model directory or hub id (default: the demo model)")
    groups = {title: p.add_argument_group(title) for title in _GROUPS}
    add_flags(ServeOptions, groups)  # first: its flags open the server group
    add_flags(EngineConfig, groups)
    _add_vllm_flags(groups["execution"])
    p.set_defaults(func=serve)


# `vllm serve` flags accepted so its command lines run, with nothing to do here: (flag,
# argparse options, the values accepted (None: any), why nothing is done). A value outside
# those accepted is refused, naming the flag.
_VLLM_NO_OPS: tuple[tuple[str, dict[str, Any], tuple[Any, ...] | None, str], ...] = (
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
    ("--enable-prompt-tokens-details", {"action": "store_true"}, None,
     "usage.prompt_tokens_details (cached_tokens) is always sent"),
    ("--enable-per-request-metrics", {"action": "store_true"}, None,
     "each request's queue, prefill, decode and end-to-end times are always in /metrics' histograms"),
    ("--show-hidden-metrics-for-version", {"metavar": "VERSION"}, None,
     "rlserve hides no deprecated metrics: /metrics shows every family it has"),
    ("--structured-outputs-config.backend", {"metavar": "xgrammar"}, ("auto", "xgrammar"),
     "structured outputs always use xgrammar"),
    ("--watermark-config", {"metavar": "JSON"}, None,
     "watermarking is not implemented; a request that asks for it (watermarking: true) is refused"),
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
        config = EngineConfig(**{**flag_values(EngineConfig, args), "model": model, "served_model_name": served_name,
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
    return lifecycle.serve(config, ServeOptions(**flag_values(ServeOptions, args),
                                                generation_defaults=defaults))


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
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    serve_parser = commands.choices["serve"]
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
