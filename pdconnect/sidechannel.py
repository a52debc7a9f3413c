"""The side channel: request/reply over zmq between decode engines, the router and a prefill engine.

The prefill engine runs one `SideChannelServer` (a ROUTER socket served by a daemon
thread); decode workers, decode schedulers and the router talk to it through
`SideChannelClient` (a DEALER socket with a deadline on every request, recreated
after a timeout so a lost reply can never wedge the next request).

The server never touches engine state itself: its handler must be thread-safe (the
connector's handler only enqueues events for the scheduler thread or reads immutable
handshake data).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import zmq

from pdconnect.protocol import (
    Ack,
    Message,
    ProtocolError,
    Refusal,
    Release,
    decode_message,
    encode_message,
)

__all__ = ["SideChannelError", "SideChannelServer", "SideChannelClient", "release_remote"]

logger = logging.getLogger("pdconnect.sidechannel")

Handler = Callable[[Message], Message]


class SideChannelError(RuntimeError):
    """The peer did not answer in time, refused, or answered something unexpected."""


class SideChannelServer:
    """Serves one handler on `tcp://host:port` from a daemon thread until `close()`."""

    def __init__(self, host: str, port: int, handler: Handler, secret: bytes | None = None) -> None:
        self._handler = handler
        self._secret = secret
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        try:
            self._socket.bind(f"tcp://{host}:{port}")
        except zmq.ZMQError as exc:
            self._socket.close()
            self._context.term()
            raise SideChannelError(f"cannot bind side channel on {host}:{port}: {exc}") from None
        self.address = self._socket.getsockopt_string(zmq.LAST_ENDPOINT)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="pdconnect-sidechannel", daemon=True)
        self._thread.start()
        logger.info("side channel listening on %s", self.address)

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._socket, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(100):
                continue
            identity, data = self._socket.recv_multipart()
            self._socket.send_multipart([identity, encode_message(self._answer(data), self._secret)])
        self._socket.close()
        self._context.term()

    def _answer(self, data: bytes) -> Message:
        try:
            message = decode_message(data, self._secret)
        except ProtocolError as exc:
            logger.warning("side channel refused a message: %s", exc)
            return Refusal(reason=str(exc))
        try:
            return self._handler(message)
        except Exception as exc:  # a handler bug must not kill the serving thread
            logger.exception("side channel handler failed on %s", type(message).__name__)
            return Refusal(reason=f"internal error: {exc}")

    @property
    def port(self) -> int:
        """The bound port (useful when asked to bind port 0)."""
        return int(self.address.rsplit(":", 1)[1])

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)


class SideChannelClient:
    """Sends one message at a time to a server and waits for its reply, with a deadline."""

    def __init__(self, address: str, secret: bytes | None = None, timeout: float = 5.0) -> None:
        self.address = address
        self._secret = secret
        self._timeout_ms = int(timeout * 1000)
        self._context = zmq.Context.instance()
        self._socket: zmq.Socket | None = None
        self._lock = threading.Lock()

    def _connected(self) -> zmq.Socket:
        if self._socket is None:
            self._socket = self._context.socket(zmq.DEALER)
            self._socket.setsockopt(zmq.LINGER, 0)
            self._socket.connect(self.address)
        return self._socket

    def _reset(self) -> None:
        if self._socket is not None:
            self._socket.close()
            self._socket = None

    def request(self, message: Message) -> Message:
        """Send and wait; raises SideChannelError on timeout, refusal or a bad reply."""
        with self._lock:
            socket = self._connected()
            socket.send(encode_message(message, self._secret))
            if not socket.poll(self._timeout_ms, zmq.POLLIN):
                # The reply may still arrive later; a fresh socket cannot confuse it with
                # the answer to the next request.
                self._reset()
                raise SideChannelError(
                    f"no answer from {self.address} within {self._timeout_ms / 1000:.1f}s"
                )
            data = socket.recv()
        try:
            reply = decode_message(data, self._secret)
        except ProtocolError as exc:
            raise SideChannelError(f"bad reply from {self.address}: {exc}") from None
        if isinstance(reply, Refusal):
            raise SideChannelError(f"{self.address} refused {type(message).__name__}: {reply.reason}")
        return reply

    def close(self) -> None:
        with self._lock:
            self._reset()


def release_remote(
    address: str, request_ids: list[str], reason: str, secret: bytes | None = None, timeout: float = 2.0
) -> Ack:
    """Tell a prefill engine to free requests' blocks now (e.g. the client went away)."""
    client = SideChannelClient(address, secret, timeout)
    try:
        reply = client.request(Release(request_ids=request_ids, reason=reason))
    finally:
        client.close()
    if not isinstance(reply, Ack):
        raise SideChannelError(f"{address} answered {type(reply).__name__} to a release")
    return reply
