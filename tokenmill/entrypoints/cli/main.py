"""The `tokenmill` command: serve, generate, chat, bench."""

from __future__ import annotations

import argparse
import logging
import sys

from tokenmill import __version__
from tokenmill.errors import TokenmillError


def build_parser() -> argparse.ArgumentParser:
    from tokenmill.entrypoints.cli import bench, calibrate, estimate, generate, router, serve, simulate

    parser = argparse.ArgumentParser(prog="tokenmill", description="LLM inference engine and OpenAI-compatible server.")
    parser.add_argument("--version", action="version", version=f"tokenmill {__version__}")
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    sub = parser.add_subparsers(dest="command", required=True)
    serve.register(sub)
    generate.register(sub)
    bench.register(sub)
    calibrate.register(sub)
    estimate.register(sub)
    simulate.register(sub)
    router.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    try:
        parser = build_parser()
        args = parser.parse_args(argv)
    except TokenmillError as e:  # e.g. a malformed TOKENMILL_* environment variable
        print(f"tokenmill: error: {e}", file=sys.stderr)
        return 2
    level = args.log_level.upper()
    if args.command in ("generate", "chat") and args.log_level == "info":
        level = "WARNING"  # keep the terminal for the model's text
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args) or 0
    except TokenmillError as e:
        print(f"tokenmill: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
