"""What a prompt's KV is a function of, as one digest both engines compute the same way.

A transfer plan names its prompt by this digest and the decode engine refuses a plan
whose digest differs from its own request's: otherwise a plan made for prompt A, sent
with a prompt B of the same length, would put A's KV into the cache under B's hashes.

vLLM's block hashes cannot serve here: each engine seeds them at random (`NONE_HASH`
comes from `os.urandom` unless `PYTHONHASHSEED` is set). So the digest covers what the
block hashes cover: the prompt's token ids, the LoRA adapter, the cache salt and the
multimodal inputs' identifiers.
"""

from __future__ import annotations

import hashlib
from array import array
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vllm.v1.request import Request

__all__ = ["prompt_digest"]


def prompt_digest(request: Request) -> str:
    """A short stable digest of everything the prompt's KV depends on."""
    digest = hashlib.sha256()
    tokens = request.prompt_token_ids or []
    digest.update(len(tokens).to_bytes(8, "little"))
    digest.update(array("q", tokens).tobytes())
    lora = request.lora_request
    extras = (
        f"lora={lora.lora_name if lora is not None else ''}",
        f"salt={request.cache_salt or ''}",
        *(f"mm={feature.identifier}@{feature.mm_position.offset}" for feature in request.mm_features),
    )
    digest.update("\x00".join(extras).encode())
    return digest.hexdigest()[:32]
