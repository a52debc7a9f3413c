"""The repository's own experiments, behind `make demo` and `make bench-*`: run from a checkout, never installed.

Each module is run as `python -m benchmarks.<name>` from the repository root:

- `demo`: `make demo`, real P/D engines measured with replay slack on, then off.
- `routing`: `make bench-routing`, four routers' decode-local hits and load on 2P+2D engines.
- `router_overhead`: `make bench-router`, what the router adds per request, beside vllm-router.
- `transfer_speed`: `make bench-transfer`, transport throughput against each library's bare API.
- `sibling_waits`: `make bench-coalesce`, the decode side's sibling waits (coalescing) on vs off.
- `handoff`: `make bench-handoff`, vLLM's NixlConnector vs ours (NIXL, Mooncake) and in-engine pull latency.
- `parallel`: `make bench-parallel`, P/D across TP and DP shapes, bytes pulled per decode rank vs needed.
- `planner`: `make bench-plan`, the planner's cost per request beside a prefix-cache lookup.
- `fleet`: `make bench-fleet`, the router's KV index fed by 64 engine cores' vLLM events.

`engine_phase` is how each one that starts engines says it was interrupted or failed;
`options` holds the command-line options they share; `rank_bytes` is `parallel`'s
arithmetic of the bytes each decode rank needs against what it pulled; `mla_model`
generates the tiny DeepSeek-V2-shaped MLA model (one latent KV head) that issue 31's
MLA pairings were tried on.

They drive local processes through `pdconnect.testbed` and measure with `pdconnect.bench`.
"""
