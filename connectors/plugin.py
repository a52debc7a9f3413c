"""vLLM plugin entry point: registers the connector name `PDConnector` with vLLM's factory.

vLLM runs general plugins in every process it starts (API server, engine core, workers),
possibly more than once; registration is lazy (module path + class name), so nothing
of ours is imported until an engine is configured with `kv_connector: PDConnector`.
The one thing it starts is the stall watch, when the operator asks for it
(`PDCONNECT_STALL_WATCH_SECONDS`, see `pdconnect.stallwatch`): every vLLM process then
writes what its threads did whenever its Python stops running for that long.
"""

from __future__ import annotations

import contextlib

from pdconnect.stallwatch import start_from_environment

CONNECTOR_NAME = "PDConnector"
CONNECTOR_MODULE = "connectors.pd_connector"


def register() -> None:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    with contextlib.suppress(ValueError):  # already registered by an earlier load of the plugins in this process
        KVConnectorFactory.register_connector(CONNECTOR_NAME, CONNECTOR_MODULE, CONNECTOR_NAME)
    start_from_environment()  # a no-op unless asked for, and at most one watch a process
