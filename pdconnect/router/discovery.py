"""Engines from DNS: re-resolve names (Kubernetes headless services) and sync the registry.

A headless service has one A/AAAA record per ready pod, so re-resolving it is the
cheapest way to follow scale-ups, restarts and rollouts without a Kubernetes client.
A failed lookup keeps the previous set: a DNS hiccup must not drop every engine,
and engines that really went away fail their health polls anyway.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
from collections.abc import Awaitable, Callable

from pdconnect.router.config import DnsTarget
from pdconnect.router.engines import EngineRegistry, Role

__all__ = ["DnsDiscovery", "Resolver", "resolve_addresses", "url_of"]

logger = logging.getLogger("pdconnect.router.discovery")

Resolver = Callable[[str, int], Awaitable[list[str]]]


async def resolve_addresses(host: str, port: int) -> list[str]:
    """All distinct IP addresses of `host` (the loop's getaddrinfo, off the loop thread)."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return sorted({str(info[4][0]) for info in infos})


def url_of(scheme: str, address: str, port: int) -> str:
    """`scheme://address:port`, an IPv6 address in brackets."""
    host = f"[{address}]" if ipaddress.ip_address(address).version == 6 else address
    return f"{scheme}://{host}:{port}"


class DnsDiscovery:
    """Keeps the registry's engines for one DNS target equal to its current records."""

    def __init__(
        self,
        registry: EngineRegistry,
        role: Role,
        target: DnsTarget,
        interval: float,
        resolver: Resolver = resolve_addresses,
        on_failure: Callable[[], None] = lambda: None,
    ) -> None:
        self._registry = registry
        self._role = role
        self._target = target
        self._interval = interval
        self._resolver = resolver
        self._on_failure = on_failure
        self.source = f"dns:{target}"

    async def refresh(self) -> None:
        try:
            addresses = await self._resolver(self._target.host, self._target.port)
        except (OSError, UnicodeError) as exc:
            self._on_failure()
            logger.warning("cannot resolve %s (%s); keeping the previous engines", self._target, exc)
            return
        urls = [url_of(self._target.scheme, a, self._target.port) for a in addresses]
        self._registry.sync(self._role, self.source, urls)

    async def run(self) -> None:
        """Resolve now and every `interval` seconds (cancel to stop)."""
        while True:
            try:
                await self.refresh()
            except Exception:  # discovery must outlive any one bad answer
                logger.exception("DNS refresh of %s failed", self._target)
                self._on_failure()
            await asyncio.sleep(self._interval)
