"""The vLLM side of pdconnect: the PDConnector, its scheduler and worker halves, the planner.

- `plugin`: vLLM's entry point; `pd_connector`: the class vLLM loads.
- `settings`: the connector's settings, parsed from `kv_connector_extra_config`;
  `transfer_params`: a request's `kv_transfer_params`, decoded once and strictly;
  `api_guard`: vLLM's API server answers 400 to `kv_transfer_params` of the wrong types,
  and names a refused pairing that `refusal_notes` noted, instead of vLLM's bare 500 or stream error event.
- `scheduler`, `producer`, `consumer`, `leases`: the scheduler half and its prefill and
  decode state machines; `lease_desk`: the prefill side channel's own process;
  `worker`: the worker half that registers KV and runs pulls.
- `replay_slack`: the planner (which blocks a request moves); `plan_checks`: decode's
  checks of a received `TransferPlan`; `plan_cli`: `pdconnect plan`.
- `geometry`, `compat`, `identity`, `metadata`, `cache_binding`, `vllm_adapter`: the
  KV geometry, what two engines must agree on, a prompt's digest, what the halves tell
  each other, and the one module that names vLLM's KV-cache internals.
- `describe`: the engine's KV cache groups, told to the router in vLLM's KV events;
  `stats`: the connector's counters; `logs`: pdconnect's log records through vLLM's
  handlers; `kvsim`: vLLM's KV managers driven without an engine (tests, benchmarks).
"""
