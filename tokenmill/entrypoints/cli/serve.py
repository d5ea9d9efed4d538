"""`tokenmill serve`: the OpenAI-compatible HTTP server."""

from __future__ import annotations


def register(sub) -> None:
    from tokenmill.entrypoints.cli.args import add_engine_args

    p = sub.add_parser("serve", help="Serve a model over an OpenAI-compatible HTTP API.")
    add_engine_args(p, positional_model=True)
    p.set_defaults(func=run)


def run(args) -> int:
    raise SystemExit("not yet")
