"""The P/D router: one OpenAI-compatible endpoint in front of prefill and decode engines.

`pdconnect router --prefill URL... --decode URL...` runs it (`app.main`); `start_router`
serves one on the current event loop. It imports neither vLLM, torch nor `connectors`
(an import contract in pyproject.toml). Modules, roughly in the order a request meets them:

- `config`: the settings as one validated `RouterConfig`; `options`: the command line
  and the `--config` file that fill it.
- `app`: the HTTP face, lifecycle and `main`; `routes`: each route's errors as OpenAI
  error JSON, and 404/405 for what no route serves; `listener`: aiohttp's server with a
  deadline on each request head, and the drain on stop; `body`: the client's body
  within limits.
- `apikeys`: client API keys the router checks, each with its rates (`ratelimit`: token
  buckets and what a request costs).
- `request`: the request's typed view (`Call`) and the bodies of its two legs; `responses`:
  the Responses API's refusals, usage and stream ends; `pools`: model pools chosen by `model`.
- `engines`: the registry; `health`: `/health` polling; `breaker`: the circuit breaker
  over request outcomes; `discovery`: engines from DNS; `replicas`: several routers over
  the same engines, each keeping its share of the engines' bounds, breaker news between them.
- `policy`: which engine serves a request. For kv-aware: `tokenizing` turns the request
  into a `prompt.RoutingPrompt` (token ids and their chain keys; `chat_template`: a chat's
  token ids as the engine computes them); `kvevents` subscribes to each engine's KV
  events, `kvwire` is their wire format, `kvindex` what each engine caches (`placement`:
  where a store's blocks stand in its range), and `lookup` vLLM's cache-hit rule over it.
- `decider`: decode-first routing, which skips the prefill leg when decode holds the prompt.
- `flow`: prefill then decode, relay, retries, fallback, abort; `attempt`: one attempt at
  one engine and what its failure says of the engine; `record`: what happened
  to one request (outcome, status, route, engines); `upstream`: the HTTP/1.1
  client that calls engines; `errors`: why a routed request failed, with its status;
  `engine_errors`: what an engine's error answer says;
  `releaser`: frees a prefill engine's blocks nobody will pull.
- `writer`: each write to the client within a deadline; `usage`: what the client is told
  it used; `metrics`: the router's Prometheus metrics; `logs`: text or JSON lines with
  the request's ids, and the access log; `tracing`: OpenTelemetry spans over OTLP.
"""

from pdconnect.router.app import Router, RunningRouter, main, start_router
from pdconnect.router.config import ConfigError, RouterConfig, load_config
from pdconnect.router.options import parse_args

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
