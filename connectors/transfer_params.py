"""A request's `kv_transfer_params`, decoded once and strictly into what it asks of the connector; never raises.

The params are client input that vLLM hands over unchecked. It copies the body's
`kv_transfer_params` (typed only as "an object") or `vllm_xargs.kv_transfer_params` (a
string, number or list) into the request's extra args, and the scheduler calls our
hooks with whatever is there. So every entry point reads the params through
`ParamsGate.ask`, which decodes them with the wire types of `pdconnect.protocol`:
- `do_remote_decode` and `do_remote_prefill` must be booleans (or absent, or null);
  other keys of the prefill leg are left alone, as proxies add their own;
- a decode leg (`do_remote_prefill` true) must be a `TransferPlan`, strictly: every field
  of the right JSON type, none missing, none unknown.

Params of the wrong JSON types are *invalid*, and an invalid request is served as if it
carried no params: computed locally, with the same tokens, counted
(`pdconnect:invalid_transfer_params_total`) and logged at a bounded rate. vLLM gives a
connector no way to refuse a request with a client error (a failed load ends as HTTP
500 "Internal server error", or a recompute), our prefill engines never emit such
params, and a client that wants local compute can get it by sending no params: so
serving is no new power, and the 500 would blame the engine for the client's input. The
400 lives one layer up (`connectors.api_guard`, the router). Well-typed plans that fail
the decode engine's own checks (`connectors.plan_checks`) are another matter: they may be
real hand-offs gone stale, and follow `kv_load_failure_policy`.

Invariant: after the first `ask` for a request, its `kv_transfer_params` are either valid
or None. Invalid ones are replaced on the request itself, so that no later reader, ours
or vLLM's own (its scheduler calls `.get` on them right after `on_new_request`), trips
on them.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, Any, cast

import msgspec

from connectors.stats import StatsRecorder
from pdconnect.protocol import ProtocolError, TransferPlan, decode_plan

if TYPE_CHECKING:
    from vllm.v1.request import Request

__all__ = ["Leg", "ParamsGate", "TransferAsk", "read_params"]

logger = logging.getLogger("pdconnect.connector")

# One warning per this many seconds at most: a client sending bad params in a loop must
# not flood the engine's log. The counter counts every one.
WARN_INTERVAL_S = 10.0


class Leg(Enum):
    """Which half of a hand-off a request asks this engine for."""

    NONE = "none"
    PREFILL = "prefill"  # `do_remote_decode`: compute, then hold the KV for a decode engine
    DECODE = "decode"  # `do_remote_prefill`: load the KV a prefill engine holds


class _Legs(msgspec.Struct, frozen=True):
    """The two flags every leg is read by; other keys pass (the decode leg is checked whole)."""

    do_remote_prefill: bool | None = None
    do_remote_decode: bool | None = None


@dataclass(frozen=True)
class TransferAsk:
    """What a request's params ask for; `invalid` says why they were refused ("" when valid)."""

    leg: Leg
    plan: TransferPlan | None = None  # the decode leg's plan
    invalid: str = ""


NO_ASK = TransferAsk(Leg.NONE)


def read_params(params: object) -> TransferAsk:
    """Decode `kv_transfer_params` of any shape; refuses what is not well typed, never raises."""
    if params is None:
        return NO_ASK
    try:
        legs = msgspec.convert(params, _Legs, strict=True)
    except msgspec.ValidationError as exc:
        return TransferAsk(Leg.NONE, invalid=f"malformed kv_transfer_params: {exc}")
    if legs.do_remote_decode:
        return TransferAsk(Leg.PREFILL)
    if not legs.do_remote_prefill:
        return NO_ASK
    try:
        # The conversion above proved `params` a JSON object.
        return TransferAsk(Leg.DECODE, decode_plan(cast("dict[str, Any]", params)))
    except ProtocolError as exc:
        return TransferAsk(Leg.NONE, invalid=str(exc))


class _BoundedWarning:
    """Logs the first call, then at most one per `interval` seconds, saying how many it held back."""

    def __init__(self, interval: float) -> None:
        self.interval = interval
        self._last = -float("inf")
        self._held_back = 0

    def warn(self, message: str, *args: object) -> None:
        now = time.monotonic()
        if now - self._last < self.interval:
            self._held_back += 1
            return
        held_back, self._held_back, self._last = self._held_back, 0, now
        if held_back:
            logger.warning("%s (%d more like it in the last %.0f s)", message % args, held_back, self.interval)
        else:
            logger.warning(message, *args)


class ParamsGate:
    """Reads each request's params once, on the scheduler thread; refusals counted and logged.

    The decoded ask is kept from a request's first sight until `forget` (vLLM's
    `request_finished`), so each request is decoded and counted once however many times
    the scheduler asks about it.
    """

    def __init__(self, stats: StatsRecorder, warn_interval: float = WARN_INTERVAL_S) -> None:
        self.stats = stats
        self._asks: dict[str, TransferAsk] = {}
        self._warning = _BoundedWarning(warn_interval)

    def ask(self, request: Request) -> TransferAsk:
        known = self._asks.get(request.request_id)
        if known is not None:
            return known
        params = request.kv_transfer_params
        if params is None:
            return NO_ASK
        ask = read_params(params)
        if ask.invalid:
            self.stats.count("invalid_transfer_params")
            self._warning.warn(
                "request %s: ignoring its kv_transfer_params, computing it locally: %s",
                request.request_id,
                ask.invalid,
            )
            request.kv_transfer_params = None
        self._asks[request.request_id] = ask
        return ask

    def forget(self, request_id: str) -> None:
        self._asks.pop(request_id, None)

    def tracked(self) -> int:
        """Requests whose ask is kept (for tests: none once every request has finished)."""
        return len(self._asks)
