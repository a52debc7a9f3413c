"""`pdconnect bench`: the operator's tool that measures a running P/D deployment.

- `cli`: the `pdconnect bench` command (scenario, deployment URLs, report paths).
- `scenarios`: the seeded workloads (probe, prefix repetition, shared prefix, multi-turn).
- `loadgen`: sends a scenario's steps to the deployment, times them, reads engine counters.
- `scrape`: reads vLLM engines' Prometheus counters (`/metrics`).
- `report`: tables, comparisons, JSON and charts of the results.

It needs a deployment, not this repository: it imports neither vLLM nor the local test
rig (`pdconnect.testbed`, checked by the import contracts in pyproject.toml).
"""
