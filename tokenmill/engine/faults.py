"""Test-only fault injection: `TOKENMILL_DEBUG_FAULTS=schedule:31999,detokenize:31998,stop_check:31997`
makes the scheduler, the detokenizer or the stop-string check raise for a request whose prompt
holds that token id, to prove that only that request fails. Nothing is wrapped when the variable
is unset, so the switches cost nothing in production. (The model-step fault is the worker's
TOKENMILL_DEBUG_FAIL_ON_TOKEN.)"""

from __future__ import annotations

import os


class InjectedFault(RuntimeError):
    pass


def _parse() -> dict[str, int]:
    spec = os.environ.get("TOKENMILL_DEBUG_FAULTS", "")
    out = {}
    for item in filter(None, (s.strip() for s in spec.split(","))):
        place, _, token = item.partition(":")
        out[place] = int(token)
    return out


def install_core(core) -> None:
    """The scheduler's fault, in the engine core (which may be its own process: the variable
    reaches it with the environment)."""
    token = _parse().get("schedule")
    if token is None:
        return
    kv = core.kv
    allocate = kv.allocate_slots

    def allocate_slots(req, *args, **kwargs):
        if token in req.prompt_token_ids:
            raise InjectedFault(f"injected scheduler fault (token {token})")
        return allocate(req, *args, **kwargs)

    kv.allocate_slots = allocate_slots


def install_output(output_processor) -> None:
    """The detokenizer's and the stop-string check's faults, in the front end."""
    faults = _parse()
    detok_token, stop_token = faults.get("detokenize"), faults.get("stop_check")
    if detok_token is None and stop_token is None:
        return
    add_request = output_processor.add_request

    def add_faulty_request(p):
        add_request(p)
        for _, child in (output_processor.child_of[r.request_id] for r in p.children):
            if detok_token in p.prompt_token_ids:
                child.detok.update = _raise("detokenizer", detok_token)
            if stop_token in p.prompt_token_ids:
                child.detok.stops = _ExplodingStops(stop_token)

    output_processor.add_request = add_faulty_request


def _raise(where: str, token: int):
    def fail(*args, **kwargs):
        raise InjectedFault(f"injected {where} fault (token {token})")

    return fail


class _ExplodingStops(list):
    """Stop strings whose check raises."""

    def __init__(self, token: int):
        super().__init__(["never"])
        self.token = token

    def __iter__(self):
        raise InjectedFault(f"injected stop-string check fault (token {self.token})")
