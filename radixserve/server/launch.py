"""`radixserve serve`: server flags, then the engine, the app and uvicorn."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from typing import Any

from radixserve.server.options import ServerOptions
from radixserve.server.chat_template import load_chat_template, template_in_force
from radixserve.tools.formats import PARSER_CHOICES
from radixserve.reasoning.registry import CHOICES as REASONING_CHOICES

API_KEY_ENV = "RADIXSERVE_API_KEY"
FINAL_WRITE_TIMEOUT_S = 5  # after the drain: time for responses to write their last event


def add_server_args(parser: argparse.ArgumentParser) -> None:
    """Flags of the HTTP server (the engine's are added by the CLI separately)."""
    group = parser.add_argument_group("server options")
    defaults = ServerOptions()
    group.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    group.add_argument("--port", type=int, default=30000)
    group.add_argument("--api-key", action="append", default=None, metavar="KEY",
                       help=f"require 'Authorization: Bearer KEY'; repeat for several keys (or set {API_KEY_ENV})")
    group.add_argument("--api-key-file", default=None, metavar="PATH",
                       help="accept the keys in PATH too: one per line ('#' starts a comment line)")
    group.add_argument("--admin-api-key", action="append", default=None, metavar="KEY",
                       help="an API key that may also act for every tenant: flush the whole prefix cache, abort "
                            "every rid; repeat for several")
    group.add_argument("--shared-cache-across-keys", action="store_true",
                       help="let all API keys share one prefix cache (a single trusted tenant); by default each "
                            "key has its own cache namespace")
    group.add_argument("--served-model-name", default=None, help="another name the model answers to")
    group.add_argument("--max-queued-requests", type=int, default=defaults.max_queued_requests,
                       help="requests waiting for their first token before new ones get 503")
    group.add_argument("--request-timeout", type=float, default=None, help="abort requests running longer (s)")
    group.add_argument("--max-n", type=int, default=defaults.max_n, help="most samples per request")
    group.add_argument("--shutdown-grace", type=float, default=defaults.shutdown_grace_s,
                       help="seconds running requests may finish at shutdown before they are aborted")
    group.add_argument("--enable-debug-endpoints", action="store_true",
                       help="serve /debug/check_integrity and /debug/stats")
    group.add_argument("--tool-call-parser", default=defaults.tool_call_parser, choices=list(PARSER_CHOICES),
                       help="how the model writes tool calls: hermes (<tool_call>{json}</tool_call>), llama3_json, "
                            "pythonic, mistral, qwen3_coder, deepseek_v3, harmony (see docs/tools.md), or auto: "
                            "detected from the chat template in force (default)")
    group.add_argument("--chat-template", default=None, metavar="PATH_OR_TEMPLATE",
                       help="a Jinja chat template (a file, or the template itself) in place of the model's own "
                            "(or of its family's built-in one, for a model file without one); the tool-call and "
                            "reasoning parsers follow it under auto")
    group.add_argument("--trust-request-chat-template", action="store_true",
                       help="let chat requests bring their own 'chat_template' (refused by default: a template is "
                            "code the server runs)")
    group.add_argument("--reply-token-reuse", default="on", choices=["on", "off"],
                       help="on (default): an earlier reply re-sent in a chat prompt gets the token ids it was "
                            "generated as, so the prefix cache hits through it; off: its text is tokenized again")
    group.add_argument("--reasoning-parser", default=defaults.reasoning_parser, choices=list(REASONING_CHOICES),
                       help="how the model writes its reasoning (vLLM's names): deepseek_r1 (everything up to "
                            "</think>), qwen3 (<think>...</think> the model opens), gpt_oss (harmony's analysis "
                            "channel), none, or auto: from the chat template (default)")
    group.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])


def server_options(args: argparse.Namespace) -> ServerOptions:
    return ServerOptions(
        api_keys=api_keys(args),
        admin_api_keys=tuple(args.admin_api_key or ()),
        shared_cache_across_keys=args.shared_cache_across_keys,
        max_queued_requests=args.max_queued_requests,
        request_timeout_s=args.request_timeout,
        max_n=args.max_n,
        shutdown_grace_s=args.shutdown_grace,
        served_model_name=args.served_model_name,
        enable_debug_endpoints=args.enable_debug_endpoints,
        reply_token_reuse=args.reply_token_reuse == "on",
        tool_call_parser=args.tool_call_parser,
        chat_template=load_chat_template(args.chat_template) if args.chat_template is not None else None,
        trust_request_chat_template=args.trust_request_chat_template,
        reasoning_parser=args.reasoning_parser,
    )


def api_keys(args: argparse.Namespace) -> tuple[str, ...]:
    """The --api-key flags and the --api-key-file lines; the environment's key when neither is given."""
    keys = list(args.api_key or [])
    if args.api_key_file:
        with open(args.api_key_file, encoding="utf-8") as f:
            lines = [line.strip() for line in f]
        file_keys = [line for line in lines if line and not line.startswith("#")]
        if not file_keys:
            raise ValueError(f"--api-key-file {args.api_key_file} holds no keys")
        keys += file_keys
    if not keys and os.environ.get(API_KEY_ENV):
        keys.append(os.environ[API_KEY_ENV].strip())
    return tuple(dict.fromkeys(keys))


def serve(args: argparse.Namespace, engine_kwargs: dict[str, Any]) -> int:
    """Load the engine, then serve until SIGINT/SIGTERM; returns the exit code. (Several
    replicas, --replicas or --ray-address, are radixserve.cluster's; __main__ dispatches.)"""
    import uvicorn

    from radixserve.engine import Engine
    from radixserve.server.app import create_app
    from radixserve.server.draining import DrainingServer

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    options = server_options(args)
    engine = Engine(**engine_kwargs)
    app = create_app(engine, options)
    print(f"radixserve: serving {engine.model_name} on http://{args.host}:{args.port}; chat template: "
          f"{template_in_force(engine.tokenizer, options.chat_template)}", file=sys.stderr, flush=True)
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        timeout_graceful_shutdown=FINAL_WRITE_TIMEOUT_S,
        access_log=args.log_level == "debug",
    )
    # On SIGINT/SIGTERM the app's requests get the grace, then end with a 503 error (a
    # stream's final event before [DONE]) before uvicorn would cancel them.
    server = DrainingServer(config, drain=lambda: app.state.server.engine.shutdown(options.shutdown_grace_s))
    # uvicorn re-raises the signal to the previous handler after shutting down: make both
    # end in KeyboardInterrupt, a clean exit.
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        server.run()
    except KeyboardInterrupt:
        pass
    return 0 if server.started else 1


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt
