"""`tokenmill serve [MODEL]`: the OpenAI-compatible HTTP server."""

from __future__ import annotations

import faulthandler
import signal
from typing import NoReturn

from tokenmill.config import ServerConfig
from tokenmill.entrypoints.cli.args import (
    add_dataclass_args,
    add_engine_args,
    dataclass_from_args,
    engine_config_from_args,
)


def register(sub) -> None:
    p = sub.add_parser("serve", help="Serve a model over an OpenAI-compatible HTTP API.",
                       description="Serve a model over an OpenAI-compatible HTTP API. Every flag can also be set "
                                   "with a TOKENMILL_<FLAG> environment variable (e.g. TOKENMILL_PORT=9000).")
    add_dataclass_args(p, ServerConfig)
    add_engine_args(p, positional_model=True)
    p.set_defaults(func=run)


def run(args) -> NoReturn:
    from tokenmill.entrypoints.openai.launcher import exit_process, run_server

    # `kill -USR1 <pid>`: every thread's stack into the log, to see where a stuck server waits
    faulthandler.register(signal.SIGUSR1, all_threads=True)

    exit_process(run_server(engine_config_from_args(args), dataclass_from_args(ServerConfig, args),
                            log_level=args.log_level))
