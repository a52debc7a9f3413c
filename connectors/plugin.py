"""vLLM plugin entry point: registers the connector name `PDConnector` with vLLM's factory.

vLLM runs general plugins in every process it starts (API server, engine core, workers),
possibly more than once; registration is lazy (module path + class name), so nothing
of ours is imported until an engine is configured with `kv_connector: PDConnector`.
"""

from __future__ import annotations

import contextlib

CONNECTOR_NAME = "PDConnector"
CONNECTOR_MODULE = "connectors.pd_connector"


def register() -> None:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    with contextlib.suppress(ValueError):  # already registered by an earlier load of the plugins in this process
        KVConnectorFactory.register_connector(CONNECTOR_NAME, CONNECTOR_MODULE, CONNECTOR_NAME)
