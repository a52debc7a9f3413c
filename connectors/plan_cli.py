"""`pdconnect plan`: shows an operator what one request will move and cache, for a model geometry."""

from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING, Any, NoReturn

from connectors.geometry import Geometry, GroupGeometry, UnsupportedLayout, consecutive_runs

if TYPE_CHECKING:
    from connectors.replay_slack import RequestPlan


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, exit 2, as for any bad input below
        self.exit(2, f"pdconnect plan: error: {message}\n")


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="pdconnect plan", description=__doc__)
    p.add_argument("--fa-block-size", type=int, required=True, help="full-attention group block size (tokens)")
    p.add_argument("--swa-block-size", type=int, required=True, help="sliding-window group block size (tokens)")
    p.add_argument("--window", type=int, required=True, help="sliding window (tokens)")
    p.add_argument("--prompt-tokens", type=int, required=True, help="prompt length N (tokens)")
    p.add_argument(
        "--eagle",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="EAGLE/MTP speculative decoding (the lookup drops one aligned block)",
    )
    p.add_argument(
        "--shared-prefix-tokens",
        type=int,
        default=None,
        metavar="J",
        help="the request's shared-prefix junction (vLLM's Request.shared_prefix_boundary: where an "
        "earlier sibling's full-attention hit ran past the sliding window's); its runs are planned too",
    )
    p.add_argument(
        "--retention-interval",
        type=int,
        default=0,
        help="vLLM prefix_cache_retention_interval (0 = replay boundaries only, the default; -1 = dense)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p


def _geometry(args: argparse.Namespace) -> Geometry:
    for flag, value in (("--fa-block-size", args.fa_block_size), ("--swa-block-size", args.swa_block_size)):
        if value <= 0:
            raise UnsupportedLayout(f"{flag} must be positive, got {value}")
    if args.window <= 0:
        raise UnsupportedLayout(f"--window must be positive, got {args.window}")
    if args.shared_prefix_tokens is not None and args.shared_prefix_tokens < 0:
        raise UnsupportedLayout(f"--shared-prefix-tokens must be >= 0, got {args.shared_prefix_tokens}")
    one_block = max(args.fa_block_size, args.swa_block_size)
    if args.prompt_tokens < one_block:
        raise UnsupportedLayout(f"--prompt-tokens {args.prompt_tokens} is shorter than one block ({one_block})")
    retention = None if args.retention_interval == -1 else args.retention_interval
    return Geometry(
        (
            GroupGeometry("full_attention", args.fa_block_size, eagle=args.eagle),
            GroupGeometry("sliding_window", args.swa_block_size, args.window, eagle=args.eagle),
        ),
        retention_interval=retention,
    )


def plan_as_dict(plan: RequestPlan, stock: RequestPlan) -> dict[str, Any]:
    return {
        "prompt_tokens": plan.num_prompt_tokens,
        "alignment": plan.alignment,
        "replay_boundaries": list(plan.replay_boundaries),
        "expected_sibling_hit_tokens": plan.expected_sibling_hit_tokens,
        "expected_resend_hit_tokens": plan.expected_resend_hit_tokens,
        "stock_sibling_hit_tokens": stock.expected_sibling_hit_tokens,
        "shared_prefix_tokens": plan.shared_prefix_tokens,
        "expected_junction_hit_tokens": plan.expected_junction_hit_tokens,
        "stock_junction_hit_tokens": stock.expected_junction_hit_tokens,
        "groups": [
            {
                "kind": g.kind,
                "block_size": g.block_size,
                "tail_blocks": list(g.tail_blocks),
                "slack_blocks": list(g.slack_blocks),
                "transfer_blocks": list(g.transfer_blocks),
                "publish_blocks": list(g.publish_blocks),
                "cached_blocks": list(g.cached_blocks),
            }
            for g in plan.groups
        ],
    }


def _ranges(indices: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2, 5'."""
    runs = consecutive_runs(indices)
    return ", ".join(str(r.start) if len(r) == 1 else f"{r.start}-{r.stop - 1}" for r in runs) or "-"


def _table(report: dict[str, Any]) -> str:
    junction = report["shared_prefix_tokens"]
    lines = [
        f"prompt {report['prompt_tokens']} tokens, alignment {report['alignment']}, "
        f"replay boundaries {report['replay_boundaries']}" + (f", junction {junction}" if junction else ""),
        f"{'group':<16}{'block':>6}  {'tail (core keeps)':<20}{'slack':<22}{'transfer':<26}publish on decode",
    ]
    lines.extend(
        f"{g['kind']:<16}{g['block_size']:>6}  {_ranges(g['tail_blocks']):<20}{_ranges(g['slack_blocks']):<22}"
        f"{_ranges(g['transfer_blocks']):<26}{_ranges(g['publish_blocks'])}"
        for g in report["groups"]
    )
    lines.append(
        f"decode-local hit of a sibling: {report['expected_sibling_hit_tokens']} tokens "
        f"(resend {report['expected_resend_hit_tokens']}; "
        f"stock tail-only transfer: {report['stock_sibling_hit_tokens']})"
    )
    if junction:
        lines.append(
            f"decode-local hit of a later sibling sharing the prefix through the junction: "
            f"{report['expected_junction_hit_tokens']} tokens (stock: {report['stock_junction_hit_tokens']})"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        geometry = _geometry(args)
        # vLLM takes seconds to import: only once the arguments are known to be sane.
        from connectors.replay_slack import plan_request
        from connectors.vllm_adapter import CacheRules

        rules = CacheRules.for_geometry(geometry)
    except UnsupportedLayout as exc:
        print(f"pdconnect plan: error: {exc}", file=sys.stderr)
        return 2
    junction = args.shared_prefix_tokens
    plan = plan_request(rules, args.prompt_tokens, shared_prefix_tokens=junction, expected_hits=True)
    stock = plan_request(
        rules, args.prompt_tokens, shared_prefix_tokens=junction, replay_slack=False, expected_hits=True
    )
    report = plan_as_dict(plan, stock)
    print(json.dumps(report) if args.json else _table(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
