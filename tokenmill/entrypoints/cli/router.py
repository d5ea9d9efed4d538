"""`tokenmill router --replica URL ...`: prefix-affinity routing over separately started servers."""

from __future__ import annotations


def register(sub) -> None:
    p = sub.add_parser("router", help="One endpoint in front of several `tokenmill serve` replicas.",
                       description="Send each request to the replica most likely to hold its prompt's leading "
                                   "KV blocks (prefix affinity), balanced by outstanding tokens.")
    p.add_argument("--replica", action="append", required=True, metavar="URL",
                   help="A replica's root URL, e.g. http://10.0.0.2:8000 (repeat for each).")
    p.add_argument("--model", default=None, help="The replicas' model (for its tokenizer). [default: the embedded one]")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("--router-policy", choices=["affinity", "least_load", "round_robin"], default="affinity")
    p.add_argument("--block-size", type=int, default=16, help="The replicas' KV block size. [default: 16]")
    p.set_defaults(func=run)


def run(args) -> int:
    from tokenmill.entrypoints.router import run_router

    return run_router(args.replica, args.model, args.host, args.port, args.router_policy, args.block_size)
