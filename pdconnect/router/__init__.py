"""The P/D router: one OpenAI-compatible endpoint in front of prefill and decode engines.

`pdconnect router --prefill URL... --decode URL...` runs it (`app.main`); `start_router`
serves one on the current event loop. Modules, in the order a request meets them:
`config` (options), `engines` (registry), `health` (polling, circuit breaker),
`discovery` (DNS), `policy` (where a request goes), `flow` (P then D, retries,
fallback, abort), `usage` (what the client is told it used), `metrics`, `app` (HTTP).
"""

from pdconnect.router.app import Router, RunningRouter, main, start_router
from pdconnect.router.config import ConfigError, RouterConfig, load_config, parse_args

__all__ = ["Router", "RunningRouter", "main", "start_router", "ConfigError", "RouterConfig",
           "load_config", "parse_args"]
