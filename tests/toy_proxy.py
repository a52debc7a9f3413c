"""What vLLM's toy P/D proxy sends with a prefill leg, for the tests that must accept it unchanged."""

from __future__ import annotations

from typing import Any

__all__ = ["TOY_PROXY_PARAMS"]

# vLLM's toy proxy's prefill request (vllm-internals.md section 5), for the stock connector.
TOY_PROXY_PARAMS: dict[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
