"""The one settings error: `ConfigError`, raised for the router's options and the connector's settings alike."""

from __future__ import annotations

__all__ = ["ConfigError"]


class ConfigError(ValueError):
    """A setting is unknown, mistyped or out of range; the message names it.

    Raised by `pdconnect.router.config` (the router's options and config file) and
    `connectors.settings` (an engine's `kv_connector_extra_config`): one class, so a
    caller catching "bad configuration" needs to know neither which part complained.
    """
