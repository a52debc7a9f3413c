"""pdconnect: the parts of the P/D service that need no vLLM (protocol, transports, router, tools).

The product:
- `protocol`, `envelope`, `sidechannel`, `notifier`: what engines and the router say to
  each other, and how it travels (zmq request/reply, signed envelopes, queued notices);
  `admission`: how many connections the side channel holds, per host and in all;
  `keyring`: the key a pod signs with and the public keys it trusts per role.
- `kvlayout`: KV tensors' shapes and strides to byte ranges; `transfer`: moving them;
  `tpmap`: which prefill TP ranks, and which of their KV heads, each decode TP rank reads.
- `router`: the P/D router (`pdconnect router`); `kvdescribe`: an engine's KV cache
  groups as its connector describes them to the router (a KV event of its own).
- `metricsproxy`: an engine's `/metrics` alone on a port of its own (`pdconnect
  metrics-proxy`), so monitoring never reaches the engine's API.
- `errors`: `ConfigError`, the one settings error; `config_fields`: a setting's bounds,
  declared once on its field's type and checked from there (the router's, the connector's).
- `serving`: runs an asyncio service until SIGINT or SIGTERM (the router, the metrics proxy).
- `sse`: the bytes that begin an engine's error and failure events in a stream, per API
  dialect (the router, the connector's API guard and the fake engine read them there).
- `stallwatch`: which threads used the seconds a process's Python stopped running.
- `cli`: the `pdconnect` command; its `plan` subcommand is the one place that reaches
  `connectors` (by name, imported only when chosen).

Around it:
- `bench`: `pdconnect bench`, the operator's tool that measures a running deployment.
- `testbed`: the local rig (processes, tiny models, a fake engine) shared by tests,
  `make demo` and `benchmarks/`; installed for the cpu-smoke images, never deployed.

The vLLM side, the connector itself, is the `connectors` package.
"""
