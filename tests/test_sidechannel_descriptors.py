"""The side channel's connection caps against the process's descriptor limit (issue 35).

The total cap (4096) was never compared with RLIMIT_NOFILE: from 8 source addresses,
50 connections each (under both caps), a server limited to 256 descriptors ran out, could
not open files or sockets, and closed connections that no counter showed. Then, with the
cap derived from the limit, zmq still accepted a burst before the gate cut it: at the
moment of the first cut the server could not open a file in about half of the runs. The
server runs here in a child process with its limit lowered; the connections are real,
over loopback.
"""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest
import zmq

from pdconnect.protocol import Ack, Heartbeat
from pdconnect.sidechannel import NoAnswer, SideChannelClient, SideChannelServer
from tests.waiting import wait_until

CHILD = r"""
import json, logging, resource, sys
resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))
from pdconnect.protocol import Ack
from pdconnect.sidechannel import SideChannelServer


def can_open_files():
    files = []
    try:
        for _ in range(16):
            files.append(open("/dev/null"))
        return True
    except OSError:
        return False
    finally:
        for file in files:
            file.close()


class AtTheCap(logging.Handler):
    # Runs on the serving thread as it logs that the flood reached the cap (it holds the
    # most connections it may, or cuts one beyond them): can the process open files then?
    opened = {}

    def emit(self, record):
        text = record.getMessage()
        if text.startswith("side channel: cut a connection"):
            moment = "first cut"
        elif text.startswith("side channel: ") and "connections held, the most allowed" in text:
            moment = "cap held"
        else:
            return
        AtTheCap.opened.setdefault(moment, can_open_files())


logging.getLogger("pdconnect.sidechannel").addHandler(AtTheCap())
server = SideChannelServer("0.0.0.0", 0, lambda message: Ack(), allow_insecure=True, engine_id="prefill-0")
print(json.dumps({"port": server.port, "max_connections": server.max_connections}), flush=True)
for line in sys.stdin:
    # What the server judged so far, whether it could open files at its first cut, and now.
    print(json.dumps({
        "counts": server.counts(),
        "held": server.connections,
        "opened_at_the_cap": AtTheCap.opened,
        "opened_now": can_open_files() if line.strip() == "files" else None,
    }), flush=True)
server.close()
"""
HOSTS = [f"127.0.0.{i}" for i in range(2, 10)]
PER_HOST = 50
# A flood at TCP's pace: a SYN dropped while the door is shut, or while the listen backlog
# is full, is retried by TCP 1, 3, 7, 15, 31 and 63 s after the first, and each wave gets
# about a backlog's worth in (on one core shared with three busy loops the count held rose
# in steps at 0.1 s and at 1.0 s). In CI the flood once stood one connection short of the
# cap through a 30 s wait, the next wave due at 31 s: the wait covers the wave at 63 s.
TCP_PACE_WAIT_S = 70.0
# A flood that redials: each client drops a connection attempt after this long and dials
# again (zmq's CONNECT_TIMEOUT), as a flood that means harm would, not waiting on TCP.
FLOOD_REDIAL_MS = 250
# How long a newcomer tries a full server (a zmq client redials a cut connection every
# 100 ms), and the bound on its getting in once a slot frees (TCP retries a dropped
# connection attempt after 1 s, 3 s, 7 s, ... from its first): neither is a measurement.
NEWCOMER_WAIT_S = 1.0
SLOT_WAIT_S = 20.0


@pytest.mark.parametrize(
    "redial_ms",
    [
        pytest.param(None, id="tcp-pace"),
        pytest.param(
            FLOOD_REDIAL_MS,
            id="redialling",
            marks=pytest.mark.xfail(
                reason="known: in one CI run of two a redialling flood left the server unable to open a file "
                "at the cap (44 cut); it passes alone, also beside busy loops. Suspected: below `watched` "
                "the door stays open, so while the gate's thread does not run zmq accepts whatever arrives.",
                strict=False,
            ),
        ),
    ],
)
def test_a_connection_flood_leaves_the_server_descriptors_and_every_close_is_counted(redial_ms: int | None) -> None:
    """8 addresses x 50 connections against a server that may open 256 descriptors: the cap
    is derived from the limit, the server can open files at the moment the flood reaches
    the cap (it holds the most it may, and cuts its first connection beyond), and after,
    and every connection cut is counted closed."""
    child = subprocess.Popen([sys.executable, "-c", CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    context = zmq.Context()
    sockets: list[zmq.Socket[bytes]] = []
    try:
        assert child.stdout is not None and child.stdin is not None
        started = json.loads(child.stdout.readline())
        assert started["max_connections"] < 256  # derived from the limit, with room left over
        for host in HOSTS:
            for _ in range(PER_HOST):
                sock = context.socket(zmq.DEALER)
                sock.setsockopt(zmq.LINGER, 0)
                if redial_ms is not None:
                    sock.setsockopt(zmq.CONNECT_TIMEOUT, redial_ms)
                sock.connect(f"tcp://{host}:0;127.0.0.1:{started['port']}")  # from `host`
                sockets.append(sock)

        def ask(what: str) -> dict[str, Any]:
            assert child.stdin is not None and child.stdout is not None
            child.stdin.write(what + "\n")
            child.stdin.flush()
            answer: dict[str, Any] = json.loads(child.stdout.readline())
            return answer

        def at_the_cap() -> dict[str, Any] | None:
            # The flood reached the cap (held it, or was cut past it), and every connection
            # cut so far is counted closed.
            answer = ask("counts")
            counts = answer["counts"]
            cut = counts["connections_over_limit"] + counts["connections_over_host_limit"]
            reached = cut > 0 or answer["held"] >= started["max_connections"]
            return answer if reached and counts["connections_closed"] >= cut else None

        judged = wait_until(
            at_the_cap,
            "the flood to reach the cap, each cut counted closed",
            TCP_PACE_WAIT_S,
            observe=lambda: ask("counts"),
        )
        # The serving thread logs as it reaches the cap; the count may be read just before.
        moments = wait_until(
            lambda: ask("counts")["opened_at_the_cap"], "the server to log that the flood reached the cap"
        )
        now = ask("files")  # the flood still dials
    finally:
        for sock in sockets:
            sock.close()
        context.term()
        child.kill()
        child.wait()
    assert all(moments.values()), f"no file could be opened at the cap: {moments} ({judged})"
    assert now["opened_now"] is True, f"no file could be opened under the flood: {now}"
    assert now["held"] <= started["max_connections"]


def test_at_the_cap_admitted_peers_are_answered_and_a_newcomer_waits_for_a_slot() -> None:
    """While the server holds its most connections its listening socket takes no new one:
    the newcomer is neither accepted nor cut (before, zmq accepted it and the gate cut it
    each time it redialled, every 100 ms), admitted peers are answered meanwhile, and the
    newcomer gets in once a connection ends."""
    server = SideChannelServer(
        "127.0.0.1", 0, lambda message: Ack(), engine_id="prefill-0", max_connections=2, max_connections_per_host=2
    )
    beat = Heartbeat(to_engine="prefill-0", request_ids=[])
    first, second, newcomer = (SideChannelClient(server.address, "decode", None, NEWCOMER_WAIT_S) for _ in range(3))
    try:
        assert first.request(beat) == Ack() and second.request(beat) == Ack()
        with pytest.raises(NoAnswer, match="not sent"):
            newcomer.request(beat)  # for NEWCOMER_WAIT_S: ten redials' worth
        counts = server.counts()
        cut = counts["connections_over_limit"] + counts["connections_over_host_limit"]
        assert cut <= 1, f"the newcomer was accepted and cut {cut} times"  # at most before the door shut
        assert first.request(beat) == Ack()
        first.close()  # a slot frees: the door opens, and TCP's next try gets in
        assert newcomer.request(beat, timeout=SLOT_WAIT_S) == Ack()
    finally:
        for client in (first, second, newcomer):
            client.close()
        server.close()
