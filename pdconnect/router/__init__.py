"""The P/D router: one OpenAI-compatible endpoint in front of prefill and decode engines.

`pdconnect router --prefill URL... --decode URL...` runs it (`app.main`); `start_router`
serves one on the current event loop. It imports neither vLLM, torch nor `connectors`
(an import contract in pyproject.toml). Modules, roughly in the order a request meets them:

- `config`: the options (file and argv) as one validated `RouterConfig`.
- `app`: the HTTP face, lifecycle and `main`; `body`: the client's body within limits.
- `engines`: the registry; `health`: polling and circuit breaker; `discovery`: DNS.
- `policy`: which engine serves a request; `kvindex` and `kvevents`: what each engine
  caches, from its KV events; `chat_template`: a chat's token ids as the engine computes them.
- `flow`: prefill then decode, retries, fallback, abort; `upstream`: the HTTP/1.1
  client that calls engines; `errors`: why a routed request failed.
- `usage`: what the client is told it used; `metrics`: the router's Prometheus metrics.
"""

from pdconnect.router.app import Router, RunningRouter, main, start_router
from pdconnect.router.config import ConfigError, RouterConfig, load_config, parse_args

__all__ = [
    "ConfigError",
    "Router",
    "RouterConfig",
    "RunningRouter",
    "load_config",
    "main",
    "parse_args",
    "start_router",
]
