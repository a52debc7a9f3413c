"""A prompt's token ids as the engine computes them: the model's tokenizer and chat template, in the router.

The kv-aware policy compares a request's token ids with what each engine caches, so it
needs the ids the engine will compute. For `/v1/completions` that is the tokenizer on
the prompt text. For `/v1/chat/completions` vLLM first renders the messages with the
model's chat template (transformers' `apply_chat_template`: jinja2 in a sandbox) and then
tokenizes the text without adding special tokens again. `PromptTokenizer` does the same
with jinja2 and `tokenizers` only: a router pod has no torch, transformers or vLLM.

What is reproduced (vLLM 0.32 with transformers 5; tests/test_router_chat_template.py
compares the ids with both, on the same model directory):

- the template as transformers finds it in the model directory (`chat_template.jinja`
  and `additional_chat_templates/`, else `tokenizer_config.json`'s `chat_template`, a
  string or named templates; `chat_template.json` last), compiled once in transformers'
  environment (`ImmutableSandboxedEnvironment`, `trim_blocks`, `lstrip_blocks`,
  `loopcontrols`, `{% generation %}`, its `tojson`, `raise_exception`, `strftime_now`),
  with the tokenizer config's named special tokens (`bos_token`, `eos_token`, ...) as
  variables;
- the conversation vLLM builds from the messages: `role`, `content` as one string (text
  parts joined by newlines) or as a list of `{"type": "text"}` parts, whichever vLLM
  detects the template iterates (its AST rules, ported below), then `reasoning`,
  `name`;
- the request's `add_generation_prompt` (default true), `continue_final_message`,
  `chat_template_kwargs`, `documents`, `reasoning_effort` (and the `enable_thinking` it
  implies) and `add_special_tokens` (default false), merged the way vLLM merges them.

Anything else — tools, tool calls and tool messages, `developer` messages, media parts,
a request's own template, prompt truncation, a salted cache — raises `NotRendered`: the
router then places the request by prefix affinity. Nothing here can fail a request: the
engines render for themselves, so a wrong guess costs a cache hit, never an answer.
Deployments that give vLLM `--chat-template`, `--chat-template-content-format` or
`--default-chat-template-kwargs` must give the router the same template (in the
tokenizer directory) or accept affinity-quality routing for chat.
"""

from __future__ import annotations

import json
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.sandbox

from pdconnect.errors import ConfigError

if TYPE_CHECKING:
    from tokenizers import Tokenizer

__all__ = [
    "ChatTemplate",
    "NotRendered",
    "PromptTokenizer",
    "detect_content_format",
    "load_template_source",
    "special_tokens_of",
]

ContentFormat = Literal["string", "openai"]

# The named special tokens transformers passes to every template (`special_tokens_map`);
# a tokenizer config may add its own `*_token` names (transformers 5: model-specific tokens).
_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# `apply_chat_template`'s own parameters: a kwarg of one of these names is consumed by
# transformers, never seen by the template.
_HF_PARAMETERS = frozenset(
    {
        "conversation",
        "tools",
        "documents",
        "chat_template",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
    }
)
# Kwargs vLLM refuses or that make transformers raise (duplicate arguments).
_REFUSED_KWARGS = ("chat_template", "tokenize", "messages", "conversation", "self")
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "
_BILLING_HEADER = "x-anthropic-billing-header"  # vLLM strips it from system text; we do not


class NotRendered(Exception):
    """The router cannot compute this request's token ids exactly; `reason` labels the metric."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


# --- the template -------------------------------------------------------------------------


class _GenerationBlocks(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` renders its body: transformers marks assistant
    tokens with it (for training masks), which changes nothing in the text."""

    tags = {"generation"}  # noqa: RUF012 - jinja2's Extension declares it `tags: set[str]`

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Callable[[], str]) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # transformers' filter: jinja2's own escapes HTML characters, which templates do not want.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)  # noqa: DTZ005 - local time, as transformers' strftime_now


def _environment() -> jinja2.sandbox.ImmutableSandboxedEnvironment:
    """transformers' `_compile_jinja_template` environment: the same text for the same template."""
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlocks, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


@dataclass(frozen=True)
class ChatTemplate:
    """One model's chat template, compiled once, with how it wants message content."""

    source: str
    compiled: jinja2.Template
    content_format: ContentFormat
    special_tokens: Mapping[str, str]

    @classmethod
    def compile(cls, source: str, special_tokens: Mapping[str, str]) -> ChatTemplate:
        """jinja2.TemplateSyntaxError when the template does not compile."""
        env = _environment()
        compiled = env.from_string(source)
        return cls(source, compiled, detect_content_format(env.parse(source)), dict(special_tokens))

    def render(self, body: Mapping[str, Any]) -> tuple[str, bool]:
        """The prompt text vLLM renders for this chat request, and whether it then adds
        special tokens when tokenizing; NotRendered for what is not reproduced."""
        variables, add_generation_prompt, continue_final, add_special_tokens = _request_variables(body)
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise NotRendered("unsupported_message", "messages must be a non-empty list")
        conversation = _conversation(messages, self.content_format)
        final_text = ""
        if continue_final:
            if "content" not in self.source:  # transformers' own check
                raise NotRendered("unsupported_request", "continue_final_message: the template has no content")
            final_text = _tag_final_message(conversation[-1])
        try:
            text = self.compiled.render(
                messages=conversation,
                tools=None,
                documents=variables.pop("documents", None),
                add_generation_prompt=add_generation_prompt,
                **{**self.special_tokens, **variables},
            )
        except Exception as exc:  # noqa: BLE001 - the template's raise_exception, sandbox, type errors
            raise NotRendered("template_error", f"{type(exc).__name__}: {exc}") from None
        if continue_final:
            text = _cut_after_final_message(text, final_text)
        return text, add_special_tokens


def _request_variables(body: Mapping[str, Any]) -> tuple[dict[str, Any], bool, bool, bool]:
    """The template variables vLLM passes for `body` (its `build_chat_params`, then
    `merge_kwargs`, then transformers' split of named parameters from template variables),
    and add_generation_prompt, continue_final_message, add_special_tokens."""
    for field in ("tools", "chat_template", "truncate_prompt_tokens", "cache_salt"):
        if body.get(field) is not None:
            # Tools: vLLM rebuilds the schemas with pydantic defaults. A request template:
            # refused unless trusted. Truncation changes the prefix. A salt changes every
            # block hash, and the index matches content only.
            raise NotRendered("unsupported_request", f"`{field}` is set")
    add_generation_prompt = body.get("add_generation_prompt", True)
    continue_final = body.get("continue_final_message", False)
    add_special_tokens = body.get("add_special_tokens", False)
    for name, value in (
        ("add_generation_prompt", add_generation_prompt),
        ("continue_final_message", continue_final),
        ("add_special_tokens", add_special_tokens),
    ):
        if not isinstance(value, bool):
            raise NotRendered("unsupported_request", f"`{name}` is not a boolean")
    if add_generation_prompt and continue_final:
        raise NotRendered("unsupported_request", "add_generation_prompt with continue_final_message")  # vLLM: 400
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise NotRendered("unsupported_request", "`chat_template_kwargs` is not an object")
    refused = [k for k in _REFUSED_KWARGS if k in kwargs]
    if refused or kwargs.get("tools") is not None or kwargs.get("return_assistant_tokens_mask"):
        raise NotRendered("unsupported_request", f"chat_template_kwargs {refused or ['tools']}")
    effort = body.get("reasoning_effort")
    extra: dict[str, Any] = {"documents": body.get("documents"), "reasoning_effort": effort}
    if effort is not None and "enable_thinking" not in kwargs:
        extra["enable_thinking"] = effort != "none"
    # vLLM merges twice (`build_chat_params`, then `with_defaults`): the request's fields
    # over its kwargs, and in the end no variable whose value is None or "auto".
    merged = {**kwargs, **{k: v for k, v in extra.items() if not _unset(v)}}
    variables = {k: v for k, v in merged.items() if not _unset(v) and (k not in _HF_PARAMETERS or k == "documents")}
    return variables, add_generation_prompt, continue_final, add_special_tokens


def _unset(value: Any) -> bool:
    """vLLM's `merge_kwargs` unset values."""
    return value is None or (isinstance(value, str) and value == "auto")


# --- messages -> vLLM's conversation --------------------------------------------------------


def _conversation(messages: Sequence[Any], content_format: ContentFormat) -> list[dict[str, Any]]:
    """vLLM's `parse_chat_messages` for text-only system, user and assistant messages."""
    conversation = []
    for message in messages:
        if not isinstance(message, dict):
            raise NotRendered("unsupported_message", "a message is not an object")
        role = message.get("role")
        if role not in ("system", "user", "assistant"):
            raise NotRendered("unsupported_message", f"role {role!r}")
        texts = _texts(message.get("content"), role)
        content: Any = [{"type": "text", "text": t} for t in texts] if content_format == "openai" else "\n".join(texts)
        out: dict[str, Any] = {"role": role, "content": content}
        if role == "assistant":
            if message.get("tool_calls"):
                raise NotRendered("unsupported_message", "assistant tool_calls")
            reasoning = message.get("reasoning")
            if reasoning is not None:
                if not isinstance(reasoning, str):
                    raise NotRendered("unsupported_message", "reasoning is not a string")
                out["reasoning"] = out["reasoning_content"] = reasoning
        for key in ("name", "task"):
            if isinstance(message.get(key), str):
                out[key] = message[key]
        conversation.append(out)
    return conversation


def _texts(content: Any, role: str) -> list[str]:
    if content is None:
        return []
    parts = [content] if isinstance(content, str) else content
    if not isinstance(parts, list):
        raise NotRendered("unsupported_message", "content is neither a string nor a list")
    texts = []
    for part in parts:
        if (
            isinstance(part, dict)
            and part.get("type") == "text"
            and part.keys() <= {"type", "text"}
            and isinstance(part.get("text"), str)
        ):
            texts.append(part["text"])
        elif isinstance(part, str):
            texts.append(part)
        else:
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise NotRendered("unsupported_message", f"content part {kind!r}")
    if role == "system" and any(t.startswith(_BILLING_HEADER) for t in texts):
        raise NotRendered("unsupported_message", "system text vLLM rewrites")
    return texts


def _tag_final_message(message: dict[str, Any]) -> str:
    """transformers' `continue_final_message`: mark where the final message's text ends."""
    content = message["content"]
    if isinstance(content, str):
        message["content"] = content + _CONTINUE_TAG
        return content
    for part in reversed(content):
        if "text" in part:
            text: str = part["text"]
            part["text"] = text + _CONTINUE_TAG
            return text
    raise NotRendered("unsupported_request", "continue_final_message: no text in the final message")


def _cut_after_final_message(text: str, final_text: str) -> str:
    tag = _CONTINUE_TAG.strip()
    if final_text.strip() not in text or tag not in text:
        raise NotRendered("template_error", "continue_final_message: the template drops the final message")
    at = text.rindex(tag)
    if text[at : at + len(_CONTINUE_TAG)] == _CONTINUE_TAG:
        return text[:at]
    return text[:at].rstrip()  # the template trimmed the message's trailing space


# --- which content format the template wants (vLLM's `_detect_content_format`) ---------------
# A template that loops over a message's content gets a list of parts ("openai"), any other
# a string. Ported rule for rule from vllm/renderers/hf.py (0.32); an error while walking
# the tree means "string" there too.


def detect_content_format(template: jinja2.nodes.Template) -> ContentFormat:
    """ "openai" when the parsed template loops over a message's content, else "string"."""
    try:
        next(_content_loops(template))
    except StopIteration:
        return "string"
    except Exception:  # noqa: BLE001 - as vLLM's detection: a template it cannot walk is "string"
        return "string"
    return "openai"


def _is_var(node: jinja2.nodes.Node, name: str) -> bool:
    return isinstance(node, jinja2.nodes.Name) and node.ctx == "load" and node.name == name


def _is_attr(node: jinja2.nodes.Node, name: str, key: str) -> bool:
    if isinstance(node, jinja2.nodes.Getitem):
        return _is_var(node.node, name) and isinstance(node.arg, jinja2.nodes.Const) and node.arg.value == key
    if isinstance(node, jinja2.nodes.Getattr):
        return _is_var(node.node, name) and node.attr == key
    return False


def _is_var_or_elems(node: jinja2.nodes.Node, name: str, key: str | None = None) -> bool:
    if isinstance(node, jinja2.nodes.Filter):
        return node.node is not None and _is_var_or_elems(node.node, name, key)
    if isinstance(node, jinja2.nodes.Test):
        return _is_var_or_elems(node.node, name, key)
    if isinstance(node, jinja2.nodes.Getitem) and isinstance(node.arg, jinja2.nodes.Slice):
        return _is_var_or_elems(node.node, name, key)
    return _is_attr(node, name, key) if key else _is_var(node, name)


def _names_bound_to(root: jinja2.nodes.Node, name: str) -> Iterator[str]:
    """`name` and every variable assigned from it (or from a slice or filter of it)."""
    yield name
    related = deque([name])
    while related:
        current = related.popleft()
        for assign in root.find_all(jinja2.nodes.Assign):
            if _is_var_or_elems(assign.node, current):
                assert isinstance(assign.target, jinja2.nodes.Name)
                yield assign.target.name
                if assign.target.name != current:
                    related.append(assign.target.name)


def _message_names(root: jinja2.nodes.Node) -> Iterator[str]:
    """Loop variables of `{% for message in messages %}`-like loops."""
    messages = list(_names_bound_to(root, "messages"))
    for loop in root.find_all(jinja2.nodes.For):
        for name in messages:
            if _is_var_or_elems(loop.iter, name):
                assert isinstance(loop.target, jinja2.nodes.Name)
                yield loop.target.name
                break


def _content_loops(root: jinja2.nodes.Node) -> Iterator[str]:
    """Loops over a message's content, directly, through a macro parameter it is passed
    to, or over a variable named `content` outside macros."""
    messages = list(_message_names(root))
    params_by_loop: dict[int, set[str]] = {}
    loops_in_macros: set[int] = set()
    for macro in root.find_all(jinja2.nodes.Macro):
        names = {arg.name for arg in macro.args}
        params: set[str] = set()
        for call in root.find_all(jinja2.nodes.Call):
            if isinstance(call.node, jinja2.nodes.Name) and call.node.name == macro.name:
                for i, arg in enumerate(call.args):
                    if i < len(macro.args) and any(_is_var_or_elems(arg, m, "content") for m in messages):
                        params.add(macro.args[i].name)
                for keyword in call.kwargs:
                    if (
                        isinstance(keyword, jinja2.nodes.Keyword)
                        and keyword.key in names
                        and any(_is_var_or_elems(keyword.value, m, "content") for m in messages)
                    ):
                        params.add(keyword.key)
        for loop in macro.find_all(jinja2.nodes.For):
            loops_in_macros.add(id(loop))
            if params:
                params_by_loop[id(loop)] = params
    for loop in root.find_all(jinja2.nodes.For):
        if any(_is_var_or_elems(loop.iter, m, "content") for m in messages):
            assert isinstance(loop.target, jinja2.nodes.Name)
            yield loop.target.name
            continue
        loop_params = params_by_loop.get(id(loop))
        if isinstance(loop.iter, jinja2.nodes.Name) and loop_params is not None and loop.iter.name in loop_params:
            assert isinstance(loop.target, jinja2.nodes.Name)
            yield loop.target.name
            continue
        if id(loop) not in loops_in_macros and isinstance(loop.iter, jinja2.nodes.Name) and loop.iter.name == "content":
            assert isinstance(loop.target, jinja2.nodes.Name)
            yield loop.target.name


# --- the model directory ---------------------------------------------------------------------


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json stores it: a string or a serialized AddedToken."""
    if isinstance(value, str):
        return value
    content = value.get("content") if isinstance(value, dict) else None
    return content if isinstance(content, str) else None


def special_tokens_of(config: Mapping[str, Any]) -> dict[str, str]:
    """The variables transformers' `special_tokens_map` gives a template."""
    tokens = {}
    for key, value in config.items():
        if key in _SPECIAL_TOKENS or key.endswith("_token"):
            text = _token_text(value)
            if text is not None:
                tokens[key] = text
    extra = config.get("extra_special_tokens")
    if isinstance(extra, dict):
        tokens.update({k: t for k, v in extra.items() if (t := _token_text(v)) is not None})
    return tokens


def load_template_source(directory: Path, config: Mapping[str, Any]) -> str | None:
    """The template transformers would use for a request without tools, or None."""
    templates: dict[str, str] = {}
    default_file = directory / "chat_template.jinja"
    if default_file.is_file():
        templates["default"] = default_file.read_text(encoding="utf-8")
    extra_dir = directory / "additional_chat_templates"
    if extra_dir.is_dir():
        for file in sorted(extra_dir.glob("*.jinja")):
            templates[file.name.removesuffix(".jinja")] = file.read_text(encoding="utf-8")
    if not templates:  # separate files win over the config's entries
        configured = config.get("chat_template")
        if isinstance(configured, str):
            return configured
        if isinstance(configured, list):
            templates = {
                t["name"]: t["template"]
                for t in configured
                if isinstance(t, dict) and isinstance(t.get("template"), str)
            }
    if not templates and (processor_file := directory / "chat_template.json").is_file():
        source = json.loads(processor_file.read_text(encoding="utf-8")).get("chat_template")
        return source if isinstance(source, str) else None
    return templates.get("default")


class PromptTokenizer:
    """A model's tokenizer and chat template, loaded once from `--tokenizer`."""

    def __init__(self, tokenizer: Tokenizer, template: ChatTemplate | None, missing: str = "") -> None:
        self._tokenizer = tokenizer
        self.template = template
        self._missing = missing  # why there is no template

    @classmethod
    def load(cls, path: str) -> PromptTokenizer:
        """From a model (or tokenizer) directory, or a bare tokenizer.json (text prompts only).

        A template that does not compile leaves chat to prefix affinity rather than stop
        the router: vLLM fails those requests itself. A path that holds no readable
        tokenizer is a ConfigError naming it: the router would tokenize nothing.
        """
        where = Path(path)
        if not where.is_dir():
            return cls(_read_tokenizer(where), None, f"{path} is a tokenizer file, not a model directory")
        tokenizer = _read_tokenizer(where / "tokenizer.json")
        config_file = where / "tokenizer_config.json"
        try:
            config = json.loads(config_file.read_text(encoding="utf-8")) if config_file.is_file() else {}
        except (OSError, ValueError) as exc:
            raise ConfigError(f"--tokenizer: {config_file} is not readable JSON: {exc}") from None
        if not isinstance(config, dict):
            raise ConfigError(f"--tokenizer: {config_file} is not a JSON object")
        source = load_template_source(where, config)
        if source is None:
            return cls(tokenizer, None, f"{path} has no chat template")
        try:
            return cls(tokenizer, ChatTemplate.compile(source, special_tokens_of(config)))
        except jinja2.TemplateSyntaxError as exc:
            return cls(tokenizer, None, f"the chat template in {path} does not compile: {exc}")

    def text(self, prompt: str, add_special_tokens: bool = True) -> list[int]:
        """The ids of `prompt`. Holds the GIL throughout: for short prompts."""
        return self._tokenizer.encode(prompt, add_special_tokens=add_special_tokens).ids

    def text_off_gil(self, prompt: str, add_special_tokens: bool = True) -> list[int]:
        """The same ids through the batch encoder, which releases the GIL while it works:
        for long prompts on a worker thread, so the event loop keeps serving meanwhile."""
        [encoding] = self._tokenizer.encode_batch([prompt], add_special_tokens=add_special_tokens)
        return encoding.ids

    def chat_text(self, body: Mapping[str, Any]) -> tuple[str, bool]:
        """The prompt text vLLM renders for this chat request and whether it adds special
        tokens when tokenizing it; NotRendered when not reproduced here."""
        if self.template is None:
            raise NotRendered("no_chat_template", self._missing)
        return self.template.render(body)

    def chat(self, body: Mapping[str, Any]) -> list[int]:
        """The ids vLLM computes for this chat request; NotRendered when unknown here."""
        return self.text(*self.chat_text(body))


def _read_tokenizer(path: Path) -> Tokenizer:
    """A tokenizer.json; ConfigError naming `path` when it is missing or no tokenizer."""
    from tokenizers import Tokenizer  # only the kv-aware policy needs it

    if not path.is_file():
        raise ConfigError(f"--tokenizer: {path} does not exist (expected a model directory or a tokenizer.json)")
    try:
        return Tokenizer.from_file(str(path))
    except Exception as exc:  # noqa: BLE001 - tokenizers raises a bare Exception for every failure
        raise ConfigError(f"--tokenizer: {path} is not a tokenizer file: {exc}") from None
