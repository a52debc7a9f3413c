"""What two engines must agree on before KV blocks can move between them: read from vLLM's config, judged at handshake.

`compat_info` builds this engine's record. A decode engine refuses any plan whose compat
digest differs from its own record's; `PeerVerdicts` then asks the prefill engine for its
record by handshake (a refused handshake carries it) and names each differing field with
both values, once per prefill engine and digest.
"""

from __future__ import annotations

import logging
import math
from collections import OrderedDict
from dataclasses import dataclass

from vllm.config import VllmConfig
from vllm.v1.kv_cache_interface import KVCacheConfig

from connectors.refusal_notes import RefusalNotes, notes_key
from connectors.vllm_adapter import group_kind, group_kv_heads
from pdconnect.protocol import CompatInfo, GroupCompat, HandshakeReply, Message, Refusal, describe_mismatches

__all__ = ["Key", "PeerVerdicts", "Verdict", "compat_info", "judge"]

logger = logging.getLogger("pdconnect.connector")


def _speculative(vllm_config: VllmConfig) -> str:
    spec = vllm_config.speculative_config
    if spec is None:
        return "none"
    return f"{spec.method}:{spec.num_speculative_tokens}"


def compat_info(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> CompatInfo:
    """The same object on both halves of both engines when (and only when) blocks are interchangeable.

    Block sizes, windows and EAGLE flags decide which logical block is which; heads,
    bytes per head and dtypes decide whether a block's bytes mean the same thing; the
    speculative config decides the EAGLE drop (and so which blocks a plan names). The
    TP size is left out on purpose: engines of different TP sizes exchange blocks head
    by head (`pdconnect.tpmap`), and each side's shape travels in the handshake instead.
    """
    tp_size = vllm_config.parallel_config.tensor_parallel_size
    groups = []
    for g in kv_cache_config.kv_cache_groups:
        spec = g.kv_cache_spec
        kv_heads, latent = group_kv_heads(spec, vllm_config.model_config, tp_size)
        per_rank = 1 if latent else int(getattr(spec, "num_heads", 1))
        groups.append(
            GroupCompat(
                kind=group_kind(spec),
                block_size=spec.block_size,
                sliding_window=getattr(spec, "sliding_window", None),
                eagle=g.is_eagle_group,
                kv_heads=kv_heads,
                latent=latent,
                head_page_bytes=spec.page_size_bytes // per_rank,
            )
        )
    alignment = kv_cache_config.cache_hit_alignment_tokens or math.lcm(*(g.block_size for g in groups))
    return CompatInfo(
        model=str(vllm_config.model_config.model),
        dtype=str(vllm_config.model_config.dtype),
        cache_dtype=str(vllm_config.cache_config.cache_dtype),
        groups=tuple(groups),
        cache_hit_alignment=alignment,
        speculative=_speculative(vllm_config),
        kv_layout=str(kv_cache_config.kv_cache_layout or "default"),
    )


Key = tuple[str, str, str]  # (prefill engine id, side-channel address, the plan's compat digest)


@dataclass(frozen=True)
class Verdict:
    """Why plans of one compat digest from one prefill engine are refused.

    `reason` is a fixed word (a `COMPAT_REASONS` entry), fit for a metric label;
    `message` names every differing field with both values (logged once per prefill
    engine); `short` names the first field, for each refused request. `lasting` verdicts
    hold for every later plan of the same key; the others (no answer, a record that is
    not the plan's) are told to the requests waiting and asked again next time.
    """

    reason: str
    message: str
    short: str
    lasting: bool


def judge(ours: CompatInfo, key: Key, answer: Message | None, failure: str = "") -> Verdict:
    """The verdict on `key`'s plans from the prefill engine's handshake answer (None with
    `failure` when there was none)."""
    engine, address, digest = key
    head = f"kv_transfer_params come from an incompatible prefill engine: {engine!r} at {address}"
    theirs = answer.compat if isinstance(answer, (HandshakeReply, Refusal)) else None
    if theirs is None:
        why = failure or (answer.reason if isinstance(answer, Refusal) else f"answered {type(answer).__name__}")
        message = f"{head}: its compat digest differs and its handshake failed: {why}"
        return Verdict("handshake", message, message, False)
    mismatches = ours.mismatches(theirs)
    if not mismatches:
        message = (
            f"{head}: the plan's compat digest {digest} is not that engine's record ({theirs.digest()}), "
            "which matches this engine's: a stale or altered plan"
        )
        return Verdict("digest", message, message, False)
    named = describe_mismatches(mismatches, ours="this decode engine", theirs="prefill engine")
    stale = theirs.digest() != digest
    tail = f" (and the plan's compat digest {digest} is not that engine's record's either)" if stale else ""
    more = f" and {len(mismatches) - 1} more" if len(mismatches) > 1 else ""
    first = mismatches[0]
    short = (
        f"{head}: {first.where} {first.theirs!r} there, {first.ours!r} here{more} (every field logged at its handshake)"
    )
    return Verdict(first.reason, f"{head}: {named}{tail}", short, not stale)


class PeerVerdicts:
    """Decode side: what the handshake told of the prefill engines whose plans carry
    another compat digest than this engine's. Scheduler thread only.

    A plan whose digest differs is always refused (the digest is the integrity check);
    the handshake only finds out which fields differ, once per (engine, address,
    digest): the first such plan asks, plans arriving meanwhile wait for the same
    answer, later ones are refused from the cache. Addresses come from client-supplied
    plans, so the cache is bounded (oldest verdict forgotten first). Each verdict is
    noted for the API server (`connectors.refusal_notes`), which answers the refused
    requests' clients with it.
    """

    def __init__(self, ours: CompatInfo, limit: int = 1024, notes: RefusalNotes | None = None) -> None:
        self.ours = ours
        self._notes = notes or RefusalNotes(None)
        self._limit = limit
        self._lasting: OrderedDict[Key, Verdict] = OrderedDict()
        self._asking: dict[str, set[Key]] = {}  # address -> keys waiting for its answer
        self._told: OrderedDict[Key, Verdict] = OrderedDict()  # passing verdicts, until asked again

    def verdict(self, key: Key) -> Verdict | None:
        """The verdict on `key`, or None while it is being asked."""
        return self._lasting.get(key) or self._told.get(key)

    def ask(self, key: Key) -> bool:
        """Note that a plan of `key` waits; True when a handshake must be sent for it.

        A passing verdict is for the requests that waited for it: a new plan asks again.
        """
        self._told.pop(key, None)
        if key in self._lasting:
            return False
        waiting = self._asking.setdefault(key[1], set())
        first = not waiting
        waiting.add(key)
        return first

    def answer(self, address: str, answer: Message | None, failure: str = "") -> list[Verdict]:
        """Judge every key waiting on `address`; the new verdicts (each logged once)."""
        made = []
        for key in sorted(self._asking.pop(address, ())):
            verdict = judge(self.ours, key, answer, failure)
            kept = self._lasting if verdict.lasting else self._told
            kept[key] = verdict
            self._notes.write(notes_key(*key), verdict.message)
            while len(kept) > self._limit:
                kept.popitem(last=False)
            if verdict.lasting:
                logger.error("refusing plans from prefill engine %r at %s: %s", key[0], address, verdict.message)
            else:
                logger.warning("refusing a plan from prefill engine %r at %s: %s", key[0], address, verdict.message)
            made.append(verdict)
        return made
