"""`pdconnect plan`: shows an operator what one request will move and cache, for a model geometry.

With `--prefill-tp`/`--decode-tp` it also shows, for engines of unequal TP sizes, what
each decode rank reads from which prefill rank (`pdconnect.tpmap`), head ranges included.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from connectors.geometry import Geometry, GroupGeometry, GroupKind, UnsupportedLayout, consecutive_runs
from pdconnect.tpmap import GroupHeads, PairingError, check_pairing, rank_reads, source_ranks

if TYPE_CHECKING:
    from connectors.replay_slack import RequestPlan


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, exit 2, as for any bad input below
        self.exit(2, f"pdconnect plan: error: {message}\n")


_KINDS: dict[str, GroupKind] = {"full": "full_attention", "sliding": "sliding_window"}
_GROUP_HELP = (
    "one KV cache group, repeatable, in vLLM's group order: full:BLOCK, sliding:BLOCK:WINDOW, or "
    "sliding:BLOCK:WINDOW:uncached for a window vLLM does not prefix-cache (DeepSeek-V4.1's bounded replay)"
)


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="pdconnect plan", description=__doc__)
    p.add_argument("--fa-block-size", type=int, help="full-attention group block size (tokens)")
    p.add_argument("--swa-block-size", type=int, help="sliding-window group block size (tokens)")
    p.add_argument("--window", type=int, help="sliding window (tokens)")
    p.add_argument("--group", action="append", default=[], metavar="SPEC", help=_GROUP_HELP)
    p.add_argument(
        "--config",
        type=Path,
        metavar="CONFIG_JSON",
        help="a model's Hugging Face config.json: its groups as vLLM would build them (needs --block-size)",
    )
    p.add_argument("--block-size", type=int, help="with --config: the engine's --block-size (tokens)")
    p.add_argument("--prompt-tokens", type=int, required=True, help="prompt length N (tokens)")
    p.add_argument(
        "--eagle",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="EAGLE/MTP speculative decoding (the lookup drops one aligned block); default: on, "
        "or with --config on when the model has MTP layers (num_nextn_predict_layers)",
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
    p.add_argument("--prefill-tp", type=int, default=1, help="the prefill engine's tensor-parallel size")
    p.add_argument("--decode-tp", type=int, default=1, help="the decode engine's tensor-parallel size")
    p.add_argument(
        "--kv-heads",
        type=int,
        default=None,
        help="KV heads model-wide (every group; with --config: the config's num_key_value_heads)",
    )
    p.add_argument(
        "--swa-kv-heads",
        type=int,
        default=None,
        help="KV heads of the sliding-window groups, where they differ (config: swa_num_key_value_heads)",
    )
    p.add_argument(
        "--mla",
        action="store_true",
        help="one latent (MLA) KV head, whole on every rank (config: kv_lora_rank set)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p


def _positive(flag: str, value: int) -> int:
    if value <= 0:
        raise UnsupportedLayout(f"{flag} must be positive, got {value}")
    return value


def _group_from_spec(spec: str, eagle: bool) -> GroupGeometry:
    """`full:256`, `sliding:64:128`, `sliding:64:128:uncached` -> a group."""
    kind_name, *fields = spec.split(":")
    uncached = fields[-1:] == ["uncached"]
    numbers = fields[:-1] if uncached else fields
    kind = _KINDS.get(kind_name)
    if kind is None or len(numbers) != (2 if kind == "sliding_window" else 1):
        raise UnsupportedLayout(f"--group {spec!r}: expected full:BLOCK or sliding:BLOCK:WINDOW[:uncached]")
    try:
        block, *window = (int(n) for n in numbers)
    except ValueError:
        raise UnsupportedLayout(f"--group {spec!r}: block size and window must be integers") from None
    _positive(f"--group {spec!r} block size", block)
    if window:
        _positive(f"--group {spec!r} window", window[0])
    return GroupGeometry(kind, block, window[0] if window else None, eagle=eagle, prefix_cacheable=not uncached)


def _groups_from_flags(args: argparse.Namespace, eagle: bool) -> tuple[GroupGeometry, ...]:
    old = {"--fa-block-size": args.fa_block_size, "--swa-block-size": args.swa_block_size, "--window": args.window}
    given = [flag for flag, value in old.items() if value is not None]
    sources = (["--group"] if args.group else []) + (["--config"] if args.config else []) + given[:1]
    if len(sources) != 1:
        raise UnsupportedLayout(
            "describe the groups one way: --group (repeated), --config, or --fa-block-size/--swa-block-size/--window"
        )
    if args.group:
        return tuple(_group_from_spec(spec, eagle) for spec in args.group)
    missing = [flag for flag, value in old.items() if value is None]
    if missing:
        raise UnsupportedLayout(f"{', '.join(missing)} required with {given[0]}")
    return (
        GroupGeometry("full_attention", _positive("--fa-block-size", args.fa_block_size), eagle=eagle),
        GroupGeometry(
            "sliding_window",
            _positive("--swa-block-size", args.swa_block_size),
            _positive("--window", args.window),
            eagle=eagle,
        ),
    )


@dataclass(frozen=True)
class ModelLayers:
    """A model's attention layers as its config.json gives them, before vLLM sizes the blocks.

    Each layer is (kind, KV heads, head size, window); `has_mtp`: the checkpoint carries
    MTP layers (`num_nextn_predict_layers`), which vLLM serves as an EAGLE-style drafter.
    """

    layers: tuple[tuple[GroupKind, int, int, int | None], ...]
    has_mtp: bool
    latent: bool = False  # MLA (`kv_lora_rank`): one latent KV head


def read_config(path: Path) -> dict[str, Any]:
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise UnsupportedLayout(f"--config {path}: {exc}") from None
    if not isinstance(config, dict):
        raise UnsupportedLayout(f"--config {path}: not a JSON object")
    section = config.get("text_config", config)  # multimodal checkpoints nest the language model's
    if not isinstance(section, dict):
        raise UnsupportedLayout(f"--config {path}: text_config is not a JSON object")
    return section


def _int(config: dict[str, Any], *keys: str) -> int | None:
    """The first of `keys` the config sets, as a positive int; None when none is set."""
    for key in keys:
        value = config.get(key)
        if value is not None:
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise UnsupportedLayout(f"config {key} must be a positive integer, got {value!r}")
            return value
    return None


def model_layers(config: dict[str, Any]) -> ModelLayers:
    """Which layers slide, and their KV shapes, by the keys vLLM's model classes read.

    Layer kinds come from `layer_types` (transformers' hybrid models) or MiMo-V2's
    `hybrid_layer_pattern` (1 = sliding); a model with neither is all full attention.
    Sliding layers may have KV shapes of their own (`swa_num_key_value_heads`,
    `swa_head_dim`): that is what makes vLLM give their group a different block size.
    """
    num_layers = _int(config, "num_hidden_layers")
    if num_layers is None:
        raise UnsupportedLayout("config has no num_hidden_layers")
    if isinstance(config.get("layer_types"), list):
        sliding = [t == "sliding_attention" for t in config["layer_types"]]
        unknown = set(config["layer_types"]) - {"sliding_attention", "full_attention"}
        if unknown:
            raise UnsupportedLayout(f"config layer_types {sorted(unknown)} are not attention pdconnect can plan")
    elif isinstance(config.get("hybrid_layer_pattern"), list):
        sliding = [bool(t) for t in config["hybrid_layer_pattern"]]
    else:
        sliding = [False] * num_layers
    if len(sliding) != num_layers:
        raise UnsupportedLayout(f"config names {len(sliding)} layer kinds for {num_layers} layers")
    window = _int(config, "sliding_window", "sliding_window_size")
    if any(sliding) and window is None:
        raise UnsupportedLayout("config has sliding layers but no sliding_window")
    heads = _int(config, "num_key_value_heads", "num_attention_heads") or 1
    head_size = _int(config, "head_dim") or (_int(config, "hidden_size") or 1) // (
        _int(config, "num_attention_heads") or 1
    )
    swa_heads = _int(config, "swa_num_key_value_heads") or heads
    swa_head_size = _int(config, "swa_head_dim") or head_size
    return ModelLayers(
        layers=tuple(
            ("sliding_window", swa_heads, swa_head_size, window)
            if slides
            else ("full_attention", heads, head_size, None)
            for slides in sliding
        ),
        has_mtp=bool(_int(config, "num_nextn_predict_layers")),
        latent=_int(config, "kv_lora_rank") is not None,
    )


def groups_for_model(model: ModelLayers, block_size: int, eagle: bool) -> tuple[GroupGeometry, ...]:
    """One group per distinct (kind, block size, window), in the order of their first layer.

    The block sizes are vLLM's own (`unified_block_sizes`); vLLM may split one such spec
    over several groups of equal layer count, which plan identically.
    """
    from connectors.vllm_adapter import unified_block_sizes  # vLLM: only for a config

    sizes = unified_block_sizes(model.layers, block_size)
    specs = dict.fromkeys((kind, size, window) for (kind, _, _, window), size in zip(model.layers, sizes))
    return tuple(GroupGeometry(kind, size, window, eagle=eagle) for kind, size, window in specs)


def _geometry(args: argparse.Namespace) -> Geometry:
    if args.shared_prefix_tokens is not None and args.shared_prefix_tokens < 0:
        raise UnsupportedLayout(f"--shared-prefix-tokens must be >= 0, got {args.shared_prefix_tokens}")
    retention = None if args.retention_interval == -1 else args.retention_interval
    if args.config is not None and not (args.group or args.fa_block_size or args.swa_block_size or args.window):
        if args.block_size is None:
            raise UnsupportedLayout("--config needs --block-size (the engine's --block-size)")
        layers = model_layers(read_config(args.config))
        eagle = layers.has_mtp if args.eagle is None else args.eagle
        groups = groups_for_model(layers, _positive("--block-size", args.block_size), eagle)
    else:
        if args.block_size is not None:
            raise UnsupportedLayout("--block-size goes with --config")
        groups = _groups_from_flags(args, True if args.eagle is None else args.eagle)
    one_block = max(g.block_size for g in groups)
    if args.prompt_tokens < one_block:
        raise UnsupportedLayout(f"--prompt-tokens {args.prompt_tokens} is shorter than one block ({one_block})")
    return Geometry(groups, retention_interval=retention)


def _group_heads(args: argparse.Namespace, geometry: Geometry) -> list[GroupHeads]:
    """Each group's KV heads, from the flags or the config (the flags win)."""
    heads, swa_heads, latent = args.kv_heads, args.swa_kv_heads, args.mla
    if args.config is not None:
        config = read_config(args.config)
        heads = heads or _int(config, "num_key_value_heads", "num_attention_heads")
        swa_heads = swa_heads or _int(config, "swa_num_key_value_heads")
        latent = latent or _int(config, "kv_lora_rank") is not None
    if latent:
        return [GroupHeads(1, latent=True) for _ in geometry.groups]
    if heads is None:
        raise UnsupportedLayout("--prefill-tp/--decode-tp need --kv-heads (or --mla, or --config)")
    return [
        GroupHeads(_positive("--kv-heads", swa_heads or heads if g.kind == "sliding_window" else heads))
        for g in geometry.groups
    ]


def tp_reads_as_dict(prefill_tp: int, decode_tp: int, groups: list[GroupHeads]) -> dict[str, Any]:
    """Per decode rank, per group: which prefill rank's heads land in which local heads.

    Raises PairingError (naming both sides' values) for a pairing that cannot work.
    """
    check_pairing(prefill_tp, groups, decode_tp, groups)
    ranks = []
    read: set[int] = set()
    for rank in range(decode_tp):
        reads = rank_reads(prefill_tp, groups, decode_tp, groups, rank)
        read.update(source_ranks(reads))
        ranks.append(
            {
                "decode_rank": rank,
                "groups": [
                    {
                        "group": g,
                        "reads": [
                            {
                                "prefill_rank": r.prefill_rank,
                                "remote_heads": [r.remote_start, r.remote_start + r.count],
                                "local_heads": [r.local_start, r.local_start + r.count],
                            }
                            for r in group_reads
                        ],
                    }
                    for g, group_reads in reads.items()
                ],
            }
        )
    return {
        "prefill_tp": prefill_tp,
        "decode_tp": decode_tp,
        "kv_heads": [{"kv_heads": g.kv_heads, "latent": g.latent} for g in groups],
        "ranks": ranks,
        # Not read, still freed by the prefill engine when the lease ends.
        "unread_prefill_ranks": sorted(set(range(prefill_tp)) - read),
    }


def _tp_table(tp: dict[str, Any]) -> str:
    lines = [f"prefill TP{tp['prefill_tp']} -> decode TP{tp['decode_tp']}: what each decode rank reads"]
    for rank in tp["ranks"]:
        for group in rank["groups"]:
            reads = "; ".join(
                f"P{r['prefill_rank']} heads {_span(r['remote_heads'])} -> heads {_span(r['local_heads'])}"
                for r in group["reads"]
            )
            lines.append(f"  decode rank {rank['decode_rank']}, group {group['group']}: {reads}")
    if tp["unread_prefill_ranks"]:
        lines.append(f"  prefill ranks not read (freed when the lease ends): {tp['unread_prefill_ranks']}")
    return "\n".join(lines)


def _span(heads: list[int]) -> str:
    start, stop = heads
    return str(start) if stop == start + 1 else f"{start}-{stop - 1}"


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
        tp = None
        if (args.prefill_tp, args.decode_tp) != (1, 1):
            tp = tp_reads_as_dict(args.prefill_tp, args.decode_tp, _group_heads(args, geometry))
    except (UnsupportedLayout, PairingError) as exc:
        print(f"pdconnect plan: error: {exc}", file=sys.stderr)
        return 2
    junction = args.shared_prefix_tokens
    plan = plan_request(rules, args.prompt_tokens, shared_prefix_tokens=junction, expected_hits=True)
    stock = plan_request(
        rules, args.prompt_tokens, shared_prefix_tokens=junction, replay_slack=False, expected_hits=True
    )
    report = plan_as_dict(plan, stock)
    if tp is not None:
        report["tp"] = tp
    text = _table(report) + ("" if tp is None else "\n" + _tp_table(tp))
    print(json.dumps(report) if args.json else text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
