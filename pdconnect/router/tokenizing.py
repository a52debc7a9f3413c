"""The kv-aware policy's view of a prompt: the token ids the engine will compute, and their chain keys.

A request's token ids are computed as the engine will (chat rendered with the model's
template, `chat_template`; text tokenized with `--tokenizer`), or not at all: a request
the router cannot render is left to the affinity key, never failed, and every outcome is
counted (`pdconnect_router_kv_aware_prompts`). What scales with the body runs on a
worker thread, and a long prompt's chain keys are computed off the loop too, once for
every lookup of the request (`RoutingPrompt`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

from prometheus_client import CollectorRegistry, Counter

from pdconnect.router.chat_template import NotRendered, PromptTokenizer
from pdconnect.router.policy import KvAware
from pdconnect.router.prompt import RoutingPrompt
from pdconnect.router.request import Call, Endpoint

__all__ = ["PromptReader"]

logger = logging.getLogger("pdconnect.router.tokenizing")

# The prompts of larger bodies are rendered and tokenized on a worker thread (whose batch
# encoder releases the GIL; jinja yields it every switch interval): inline, a long prompt
# would stall every other request on the loop (a 1 MB prompt took ~0.4 s to tokenize on
# these machines, a 4 MiB chat of tiny messages ~0.4 s to render); a short one costs
# less inline than the thread hop.
_INLINE_PROMPT_BYTES = 8192
# The same for the prompt's chain keys (pure Python, ~50 us per 1k tokens and block size):
# a longer prompt's are computed off the loop, all at once, before any lookup needs them.
_INLINE_KEY_TOKENS = 2048


class PromptReader:
    """Turns a request into its `RoutingPrompt`, for the kv-aware policy and the decider.
    `tokenizer`: `--tokenizer`, loaded (None: only prompts sent as token ids are read).
    `kv_aware`: whose engines' key granularities a long prompt's chain keys are computed at."""

    def __init__(
        self, tokenizer: PromptTokenizer | None, kv_aware: KvAware | None, registry: CollectorRegistry
    ) -> None:
        self._kv_aware = kv_aware
        self._tokenizer = tokenizer
        # Not in RouterMetrics: only a kv-aware flow has prompts to turn into token ids.
        self._prompt_results = Counter(
            "pdconnect_router_kv_aware_prompts",
            "kv-aware: requests whose prompt token ids the router computed (result=ok), or could not "
            "(result=the reason: no_tokenizer, no_chat_template, unsupported_request, unsupported_message, "
            "template_error, tokenizer_error), placed by prefix affinity instead",
            ["endpoint", "result"],
            registry=registry,
        )
        self._tokenize_pool: ThreadPoolExecutor | None = None  # made on the first long prompt

    async def routing_prompt(self, call: Call) -> RoutingPrompt | None:
        """The request's token ids with their chain keys ready for a long prompt, or None
        (prefix affinity places the request)."""
        tokens = await self._tokens(call)
        if tokens is None:
            return None
        prompt = RoutingPrompt(tokens)
        await self._fill_keys(prompt)
        return prompt

    async def _tokens(self, call: Call) -> Sequence[int] | None:
        """The ids the engine will compute for the prompt, or None (prefix affinity places
        the request); each outcome is counted. Never an error: the engine renders for itself."""
        label = call.endpoint.label
        try:
            # Size first: what scales with the body (rendering a chat of many messages,
            # tokenizing a long text) runs on a worker thread; the loop keeps serving.
            if len(call.raw) <= _INLINE_PROMPT_BYTES:
                tokens = self._prompt_tokens(call, off_gil=False)
            else:
                if self._tokenize_pool is None:
                    self._tokenize_pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="pdconnect-tokenize")
                tokens = await asyncio.get_running_loop().run_in_executor(
                    self._tokenize_pool, self._prompt_tokens, call, True
                )
        except NotRendered as exc:
            self._prompt_results.labels(label, exc.reason).inc()
            logger.debug("kv-aware: no token ids for a %s request: %s", label, exc)
            return None
        except Exception as exc:  # noqa: BLE001 - a tokenizer bug must not fail the request either
            self._prompt_results.labels(label, "tokenizer_error").inc()
            logger.warning("kv-aware: tokenizing a %s request failed: %r", label, exc)
            return None
        self._prompt_results.labels(label, "ok").inc()
        return tokens

    async def _fill_keys(self, prompt: RoutingPrompt) -> None:
        """The chain keys a long prompt's lookups need, computed in a worker thread (the part
        of a lookup that scales with the prompt); a short prompt's lookups fill them inline."""
        if self._kv_aware is not None and len(prompt.tokens) > _INLINE_KEY_TOKENS:
            await self._kv_aware.fill_keys(prompt)

    def _prompt_tokens(self, call: Call, off_gil: bool) -> Sequence[int]:
        """The prompt's ids (`_prompt`, tokenized); `off_gil` on a worker thread."""
        prompt = self._prompt(call)
        if not isinstance(prompt, tuple):
            return prompt
        assert self._tokenizer is not None
        return self._tokenizer.text_off_gil(*prompt) if off_gil else self._tokenizer.text(*prompt)

    def _prompt(self, call: Call) -> Sequence[int] | tuple[str, bool]:
        """The prompt's ids when the client sent ids, else its text (chat: rendered) and
        whether the engine adds special tokens; NotRendered when the router cannot tell."""
        body = call.body  # the types were checked by _parse
        if body.get("cache_salt") is not None:
            # A salt changes every block hash; the index matches content only.
            raise NotRendered("unsupported_request", "`cache_salt` is set")
        if call.endpoint is Endpoint.RESPONSES:
            # vLLM renders a Responses input into a chat of its own making: not predicted here.
            raise NotRendered("unsupported_request", "a Responses API input")
        if call.endpoint is Endpoint.CHAT:
            if self._tokenizer is None:
                raise NotRendered("no_tokenizer", "no --tokenizer")
            return self._tokenizer.chat_text(body)
        prompt = body["prompt"]
        if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
            return prompt
        if not isinstance(prompt, str):
            raise NotRendered("unsupported_request", "a batch of prompts")
        if self._tokenizer is None:
            raise NotRendered("no_tokenizer", "no --tokenizer")
        add_special_tokens = body.get("add_special_tokens", True)  # vLLM's default for completions
        if not isinstance(add_special_tokens, bool):
            raise NotRendered("unsupported_request", "`add_special_tokens` is not a boolean")
        return prompt, add_special_tokens
