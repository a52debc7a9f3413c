"""NIXL (UCX backend) as a `Transport`: DRAM registration, READs, metadata exchanged by us.

What NIXL does on its own, and what we do about it:
- Its built-in metadata listener hangs unless both agents run it, so metadata travels
  in `Transport.metadata()`/`connect()` (our side channel) via `get_agent_metadata` and
  `add_remote_agent`; the listener is off.
- UCX loads its InfiniBand module when present, and with Debian's `ibverbs-providers`
  installed on a host without an RDMA NIC the process segfaults at exit. On such a
  host the module cannot help anyway, so we default `UCX_MODULES=^ib` there (operator
  settings win); on a host with RDMA devices UCX keeps them.
- Two agents, one per role. The *serving* agent (the one peers read from, whose
  metadata we publish) runs NIXL's progress thread, because a peer's connection
  wire-up needs our side to make progress and nothing else of ours would. The
  *pulling* agent (created on the first `connect`) runs none: its progress is driven by
  our own calls (`transfer`, `check_xfer_state`). Measured on 2 shared cores over
  loopback, an initiator with a progress thread sleeping 200 us between rounds posted
  reads 2-3x slower than one without (64 x 1 MiB 3.4 vs 6.1 GB/s, 4096 x 16 KiB 1.5 vs
  2.9 GB/s), and the busy loop NIXL's Python API starts by default burns a core; the
  serving agent's delay changes throughput not at all (see `PROGRESS_THREAD_DELAY_US`).
  Both agents register the same memory, so either can address it.
- Over UCX's `cma` path (both processes on one host) the copy runs inside the post
  itself, so there `pull` returns only after the bytes moved (the GIL is released
  meanwhile); across hosts the post returns at once and our polls progress it. The
  post is not moved to a helper thread because an agent without the listener runs with
  no internal locking (`NIXL_THREAD_SYNC_NONE`), and with locking every poll would wait
  behind the copy.
- The `nixl` import shim picks its backend wheel by CUDA version and, when torch is
  installed without CUDA, imports all of torch (seconds) only to learn that; we load
  the wheel it would then pick directly (see `load_nixl_api`).
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
import re
import sys
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

from pdconnect.transfer._host import env_defaults, rdma_devices
from pdconnect.transfer.ranges import Range, range_table
from pdconnect.transfer.transport import (
    LOG,
    FailedTransfer,
    MemoryRegion,
    PeerInfo,
    Transfer,
    TransferError,
    TransferState,
    Transport,
)

__all__ = ["NixlTransport", "load_nixl_api", "xfer_tables"]

_MEM = "DRAM"
# NIXL's answers from check_xfer_state / transfer.
_NIXL_STATES = {"DONE": TransferState.DONE, "PROC": TransferState.PENDING, "ERR": TransferState.FAILED}


class NixlTransport(Transport[str]):
    """Reads peers' memory with a NIXL agent; a peer handle is the remote agent's name.

    `protocol` and `device_name` are Mooncake settings: UCX picks its own transports
    (on one host it reads over `cma`, i.e. process_vm_readv), so `effective_protocol`
    is "ucx". `require_rdma` is honoured by refusing a host where UCX cannot use RDMA.
    `progress_delay_us` is the serving agent's progress-thread sleep between rounds.
    """

    name = "nixl"
    effective_protocol = "ucx"

    def __init__(
        self,
        *,
        host: str,
        protocol: str = "rdma",
        device_name: str = "",
        require_rdma: bool = False,
        progress_delay_us: int | None = None,
    ) -> None:
        super().__init__()
        delay_us = PROGRESS_THREAD_DELAY_US if progress_delay_us is None else progress_delay_us
        if delay_us < 0:
            raise TransferError(f"nixl: progress_delay_us must be >= 0, got {delay_us}")
        devices = rdma_devices()
        if not devices:
            env_defaults({"UCX_MODULES": "^ib"})
        if require_rdma and (not devices or "^ib" in os.environ.get("UCX_MODULES", "")):
            raise TransferError(
                "nixl: require_rdma is set but UCX cannot use RDMA here "
                f"(kernel RDMA devices: {', '.join(devices) or 'none'}; "
                f"UCX_MODULES={os.environ.get('UCX_MODULES', '')!r})"
            )
        if device_name:
            LOG.warning(
                "nixl: device_name=%r is a Mooncake setting, ignored (UCX chooses "
                "devices; set UCX_NET_DEVICES to pin them)",
                device_name,
            )
        try:
            api = load_nixl_api()
        except ImportError as exc:
            raise TransferError(
                f"the nixl transport needs the nixl packages (nixl-cu12 and the nixl import shim): {exc}"
            ) from None
        self._api = api
        self._agent_name = f"pdconnect-{host}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._agent = _create_agent(api, self._agent_name, progress_delay_us=delay_us)
        # Created on the first connect: an engine that only serves never needs it.
        self._puller: Any | None = None
        LOG.info(
            "nixl: agent %s, UCX backend, progress thread every %d us (requested "
            "protocol %s; RDMA devices: %s; UCX_MODULES=%s)",
            self._agent_name,
            delay_us,
            protocol,
            ", ".join(devices) or "none",
            os.environ.get("UCX_MODULES", "<unset>"),
        )

    def _register(self, regions: Sequence[MemoryRegion]) -> None:
        for agent in (self._agent, self._puller):
            if agent is not None:
                _register_with(agent, regions)

    def _endpoint(self) -> bytes:
        return bytes(self._agent.get_agent_metadata())

    def _pulling_agent(self) -> Any:
        """The agent our reads go through (no progress thread), made on first use."""
        if self._puller is None:
            puller = _create_agent(self._api, f"{self._agent_name}-pull", progress_delay_us=None)
            regions = list(self._local)
            if regions:
                _register_with(puller, regions)
            self._puller = puller
        return self._puller

    def _connect(self, peer: str, info: PeerInfo) -> str:
        puller = self._pulling_agent()
        try:
            remote = puller.add_remote_agent(info.endpoint)
        except Exception as exc:  # noqa: BLE001 - NIXL raises its own untyped errors: a TransferError
            raise TransferError(f"peer {peer}: NIXL rejected its agent metadata: {exc}") from None
        return remote.decode() if isinstance(remote, bytes) else str(remote)

    def _pull(self, handle: str, ranges: Sequence[Range], timeout: float, description: str) -> Transfer:
        puller = self._pulling_agent()
        local, remote = xfer_tables(ranges)
        xfer = None
        try:
            xfer = puller.initialize_xfer(
                "READ", puller.get_xfer_descs(local, _MEM), puller.get_xfer_descs(remote, _MEM), handle
            )
            state = puller.transfer(xfer)
        except Exception as exc:  # noqa: BLE001 - NIXL raises its own untyped errors: a failed transfer
            state, error = "ERR", f"nixl could not start the read: {exc}"
        else:
            error = "nixl refused to post the read"
        if state == "ERR":
            if xfer is not None:
                _release_quietly(puller, xfer)
            return FailedTransfer(description, error)
        return _NixlTransfer(puller, xfer, timeout, description)

    def _disconnect(self, peer: str, handle: str) -> None:
        if self._puller is None or any(p.handle == handle for p in self._peers.values()):
            return  # another of our names still reads from that agent
        try:
            self._puller.remove_remote_agent(handle)
        except Exception as exc:  # noqa: BLE001 - closing: a failure is logged, not raised
            LOG.warning("nixl: removing remote agent %s (peer %s) failed: %s", handle, peer, exc)

    def _close(self) -> None:
        # Running transfers hold their own reference to the pulling agent, so it outlives
        # them.
        del self._agent
        self._puller = None


class _NixlTransfer(Transfer):
    """A posted NIXL READ, polled with `check_xfer_state`."""

    def __init__(self, agent: Any, xfer: Any, timeout: float, description: str) -> None:
        super().__init__(description, timeout)
        self._agent = agent
        self._xfer: Any | None = xfer

    def _status(self) -> tuple[TransferState, str | None]:
        state = _NIXL_STATES.get(self._agent.check_xfer_state(self._xfer), TransferState.FAILED)
        if state is TransferState.FAILED:
            return state, "nixl reported the read failed (peer gone or connection lost)"
        return state, None

    def _release(self) -> bool:
        # Releasing an active transfer asks UCX to cancel it; if it cannot yet, the
        # handle stays and the next poll tries again.
        if self._xfer is not None and _release_quietly(self._agent, self._xfer):
            self._xfer = None
        return self._xfer is None


def _create_agent(api: ModuleType, name: str, *, progress_delay_us: int | None) -> Any:
    """A UCX agent without the metadata listener; `progress_delay_us` None = no progress
    thread (the caller's own calls progress it)."""
    config = api.nixl_agent_config(
        enable_prog_thread=progress_delay_us is not None, enable_listen_thread=False, backends=["UCX"]
    )
    try:
        with _progress_thread_delay(api, progress_delay_us or 0):
            return api.nixl_agent(name, config)
    except Exception as exc:  # noqa: BLE001 - NIXL raises its own untyped errors: a TransferError
        raise TransferError(f"nixl: could not create a UCX agent: {exc}") from None


def _register_with(agent: Any, regions: Sequence[MemoryRegion]) -> None:
    try:
        agent.register_memory([(r.addr, r.length, 0, "") for r in regions], _MEM)
    except Exception as exc:  # noqa: BLE001 - NIXL raises its own untyped errors: a TransferError
        raise TransferError(f"nixl refused to register {len(regions)} region(s): {exc}") from None


def xfer_tables(ranges: Sequence[Range]) -> tuple[Any, Any]:
    """Local and remote NIXL descriptor tables (N x [addr, length, device 0]) for ranges.

    NIXL takes numpy tables without a Python loop per descriptor; a `RangeTable` hands
    over the table it already holds.
    """
    import numpy as np

    table = range_table(ranges)
    local = np.zeros((len(table), 3), dtype=np.uint64)
    remote = np.zeros((len(table), 3), dtype=np.uint64)
    local[:, 0], local[:, 1] = table[:, 0], table[:, 2]
    remote[:, 0], remote[:, 1] = table[:, 1], table[:, 2]
    return local, remote


def _release_quietly(agent: Any, xfer: Any) -> bool:
    try:
        agent.release_xfer_handle(xfer)
    except Exception as exc:  # noqa: BLE001 - NIXL raises while the handle is still busy: tried again later
        LOG.debug("nixl: transfer handle not released yet: %s", exc)
        return False
    return True


# The backend wheels the `nixl` shim tries, in its order, when no CUDA is detected.
_SHIM_FALLBACK_ORDER = ("nixl_cu13", "nixl_cu12", "nixl_rocm")


# The serving agent needs UCX progress (a peer's connection wire-up), so it keeps its
# progress thread; but NIXL's Python API starts it with no delay between rounds, a busy
# loop that burns a whole core per engine even when idle, which starved 2-core hosts into
# minute-long stalls. Measured on 2 shared cores, loopback, reader without a progress
# thread (delay: serving agent's idle CPU; 64 x 1 MiB and 4096 x 16 KiB read GB/s; first
# read after connect): 0 us 98% of a core, 1.8, 1.0, 53 ms; 50 us 4.8%, 5.7, 2.5, 17 ms;
# 200 us 1.7-2.2%, 5.1, 2.7, 14-16 ms; 1000 us 2.1-2.3%, 4.7-6.3, 2.7-2.9, 13-15 ms;
# 5000 us 0.8%, 5.2, 2.4, 17 ms. Past the busy loop the delay no longer moves the
# transfer rate; 200 us keeps the idle cost near 2% of a core and wire-up prompt.
# `ConnectorSettings.nixl_progress_delay_us` overrides it.
PROGRESS_THREAD_DELAY_US = 200


@contextlib.contextmanager
def _progress_thread_delay(api: ModuleType, delay_us: int) -> Iterator[None]:
    """Create agents whose progress thread sleeps `delay_us` between rounds.

    The Python wrapper hard-codes `pthrDelay = 0` on the config it builds; the native
    constructor takes the config as an argument, so it is wrapped for the duration of
    one agent creation to set the delay first.
    """
    bindings = api.nixlBind
    native = bindings.nixlAgent

    def with_delay(name: str, config: Any) -> Any:
        config.pthrDelay = delay_us
        return native(name, config)

    bindings.nixlAgent = with_delay
    try:
        yield
    finally:
        bindings.nixlAgent = native


def load_nixl_api() -> ModuleType:
    """`nixl._api`, minus the shim's torch import on hosts whose torch has no CUDA."""
    if "torch" not in sys.modules and _installed_torch_lacks_cuda():
        for backend in _SHIM_FALLBACK_ORDER:
            if importlib.util.find_spec(backend) is not None:
                return importlib.import_module(f"{backend}._api")
    return importlib.import_module("nixl._api")


def _installed_torch_lacks_cuda() -> bool:
    """Whether torch is installed as a build without CUDA, read off disk, not imported."""
    try:
        spec = importlib.util.find_spec("torch")
        if spec is None or not spec.origin:
            return False
        text = (Path(spec.origin).parent / "version.py").read_text()
    except (ImportError, ValueError, OSError):
        return False
    return re.search(r"^cuda\b[^=]*=\s*None\s*$", text, re.MULTILINE) is not None
