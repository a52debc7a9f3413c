"""The `pdconnect` command: one entry point whose subcommands live with the code they drive."""

from __future__ import annotations

import importlib
import importlib.metadata
import sys

# Subcommand -> "module:function" taking argv and returning an exit code. Imported only
# when chosen, so `pdconnect router` never pulls in vLLM or torch.
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "plan": ("connectors.plan_cli:main", "show what a request moves and caches (needs vLLM)"),
    "router": ("pdconnect.router.app:main", "run the P/D router (OpenAI-compatible HTTP)"),
    "metrics-proxy": ("pdconnect.metricsproxy:main", "serve an engine's /metrics alone, on a port of its own"),
    "bench": ("pdconnect.bench.cli:main", "run benchmark scenarios against a deployment"),
    "side-channel-key": ("pdconnect.keyring:main", "print the public key of a side-channel secret"),
}


def _usage() -> str:
    lines = ["usage: pdconnect [--version] <command> [options]", "", "commands:"]
    lines += [f"  {name:<16} {help_}" for name, (_, help_) in SUBCOMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help"):
        print(_usage())
        return 0 if args else 2
    if args[0] == "--version":
        # The installed distribution's version: pyproject.toml's [project] version.
        print(f"pdconnect {importlib.metadata.version('pdconnect')}")
        return 0
    if args[0] not in SUBCOMMANDS:
        print(f"pdconnect: unknown command {args[0]!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module_name, _, function = SUBCOMMANDS[args[0]][0].partition(":")
    entry = getattr(importlib.import_module(module_name), function)
    return int(entry(args[1:]) or 0)


if __name__ == "__main__":
    sys.exit(main())
