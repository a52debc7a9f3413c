"""The router's chat rendering (`router.chat_template`) against the real thing: vLLM's own
chat renderer and transformers' `apply_chat_template`, on the tiny generated model's
tokenizer and on copies of it carrying real chat templates (Llama 3, Mistral, a
Qwen-style ChatML that iterates content parts).

The copies add the templates' markers as special tokens and make every space and newline
a token of its own, so the ids show any whitespace the template's `trim_blocks` /
`lstrip_blocks` handling gets wrong; `test_a_wrong_rendering_changes_the_ids` shows that
mistakes of each kind this module could make change the ids (the comparison can tell).
"""

from __future__ import annotations

import asyncio
import copy
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import vllm  # noqa: F401  (both suites have vLLM: an ImportError fails, never skips)

from pdconnect.router.chat_template import ChatTemplate, NotRendered, PromptTokenizer, special_tokens_of
from pdconnect.testbed.tinymodel import TinyModelSpec, ensure_model

# Meta-Llama-3-8B-Instruct's template, verbatim.
LLAMA3 = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
    "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + "
    "'<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{% endif %}"
)
# Mistral-7B-Instruct-v0.1's template, verbatim: it raises on roles that do not alternate.
MISTRAL = (
    "{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token}}"
    "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}{% endfor %}"
)
# Qwen-style ChatML written across lines (trim_blocks / lstrip_blocks matter), iterating
# content parts (vLLM then passes content as a list of parts), with Qwen3's
# `enable_thinking`, reasoning content and a `{% generation %}` block.
CHATML = """{%- for message in messages %}
    {%- if loop.first and message['role'] != 'system' %}
<|im_start|>system
w0<|im_end|>
    {% endif %}
<|im_start|>{{ message['role'] }}{% if message['name'] is defined %} {{ message['name'] }}{% endif %}

    {% if message['content'] is string %}
{{- message['content'] }}
    {%- else %}
        {%- for part in message['content'] %}
            {%- if part['type'] == 'text' %}{{ part['text'] }}{% endif %}
        {%- endfor %}
    {%- endif %}
    {%- if message['role'] == 'assistant' %}
        {%- generation %}
            {%- if message['reasoning_content'] is defined %} <think> {{ message['reasoning_content'] }} </think>{% endif %}
        {%- endgeneration %}
    {%- endif %}
<|im_end|>
{% endfor %}
{%- if add_generation_prompt %}
<|im_start|>assistant
    {%- if enable_thinking is defined and enable_thinking is false %}
 <think> </think>
    {%- endif %}
{% endif %}
"""  # noqa: E501 - the reasoning line as Qwen's template writes it
# Special tokens each copy adds, and its bos/eos.
MARKERS = {
    "llama3": (
        ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
        "<|begin_of_text|>",
        "<|eot_id|>",
    ),
    "mistral": (["[INST]", "[/INST]"], "<s>", "</s>"),
    "chatml": (["<|im_start|>", "<|im_end|>", "<think>", "</think>"], "<s>", "<|im_end|>"),
}

SYSTEM = {"role": "system", "content": "w1 w2"}
USER = {"role": "user", "content": "w3 w4"}
ASSISTANT = {"role": "assistant", "content": "w5 w6"}
USER2 = {"role": "user", "content": "w7"}
CASES: dict[str, dict[str, Any]] = {
    "system+user": {"messages": [SYSTEM, USER]},
    "multi-turn": {"messages": [SYSTEM, USER, ASSISTANT, USER2]},
    "user-assistant-user": {"messages": [USER, ASSISTANT, USER2]},
    "no-generation-prompt": {"messages": [USER, ASSISTANT], "add_generation_prompt": False},
    "continue-final-message": {
        "messages": [USER, {"role": "assistant", "content": "w5 w6 "}],
        "add_generation_prompt": False,
        "continue_final_message": True,
    },
    "text-parts": {
        "messages": [
            SYSTEM,
            {"role": "user", "content": [{"type": "text", "text": "w3 w4"}, {"type": "text", "text": "w8"}]},
        ]
    },
    "template-kwargs": {"messages": [SYSTEM, USER], "chat_template_kwargs": {"enable_thinking": False}},
    "reasoning-effort-none": {"messages": [SYSTEM, USER], "reasoning_effort": "none"},
    "kwargs-none-is-unset": {"messages": [SYSTEM, USER], "chat_template_kwargs": {"bos_token": None}},
    "kwargs-override-bos": {"messages": [USER], "chat_template_kwargs": {"bos_token": "w9"}},
    "name-and-reasoning": {"messages": [{**USER, "name": "w9"}, {**ASSISTANT, "reasoning": "w8 w8"}, USER2]},
    "add-special-tokens": {"messages": [SYSTEM, USER], "add_special_tokens": True},
}
BASIC = ("system+user", "multi-turn", "no-generation-prompt")


def _with_template(tiny: Path, out: Path, name: str, template: Any) -> Path:
    """A copy of the tiny model's config and tokenizer with `template` and its markers."""
    from tokenizers import AddedToken, Tokenizer, processors

    out.mkdir()
    shutil.copy(tiny / "config.json", out / "config.json")
    markers, bos, eos = MARKERS[name]
    tokenizer = Tokenizer.from_file(str(tiny / "tokenizer.json"))
    tokenizer.add_special_tokens([AddedToken(m, normalized=False, special=True) for m in markers])
    # Every space and newline its own token: whitespace mistakes change the ids.
    tokenizer.add_tokens([AddedToken(" ", normalized=False), AddedToken("\n", normalized=False)])
    if name == "llama3":  # like Llama 3: the tokenizer itself prepends BOS
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", special_tokens=[(bos, tokenizer.token_to_id(bos))]
        )
    tokenizer.save(str(out / "tokenizer.json"))
    config = json.loads((tiny / "tokenizer_config.json").read_text())
    config.update(bos_token=bos, eos_token=eos)
    if isinstance(template, str) and name == "mistral":
        (out / "chat_template.jinja").write_text(template)
    else:
        config["chat_template"] = template
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return out


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    tiny = ensure_model(TinyModelSpec(kind="hybrid-llama"))
    assert (tiny / "chat_template.jinja").read_text().strip(), "the tiny model ships a chat template"
    root = tmp_path_factory.mktemp("chat-models")
    return {
        "tiny": tiny,
        "llama3": _with_template(tiny, root / "llama3", "llama3", LLAMA3),
        "mistral": _with_template(tiny, root / "mistral", "mistral", MISTRAL),
        # Named templates, as some tokenizer configs carry them: the default one is used.
        "chatml": _with_template(
            tiny,
            root / "chatml",
            "chatml",
            [{"name": "default", "template": CHATML}, {"name": "tool_use", "template": "x"}],
        ),
    }


class VllmReference:
    """vLLM's own chat rendering (the OnlineRenderer its API server uses), per model directory."""

    def __init__(self) -> None:
        self._renderers: dict[Path, Any] = {}

    def _renderer(self, directory: Path) -> Any:
        if directory not in self._renderers:
            from vllm.config import ModelConfig, VllmConfig
            from vllm.renderers import renderer_from_config
            from vllm.renderers.online_renderer import OnlineRenderer

            model = ModelConfig(model=str(directory), dtype="float32", max_model_len=2048)
            self._renderers[directory] = OnlineRenderer(
                model,
                renderer_from_config(VllmConfig(model_config=model)),
                request_logger=None,
                chat_template=None,
                chat_template_content_format="auto",
            )
        return self._renderers[directory]

    def render(self, directory: Path, body: dict[str, Any]) -> tuple[str, list[int]] | None:
        """(prompt text, prompt ids), or None where vLLM refuses the request."""
        import jinja2
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
        from vllm.entrypoints.serve.engine.protocol import ErrorResponse
        from vllm.exceptions import VLLMClientError

        renderer = self._renderer(directory)
        try:  # vLLM refuses by raising (validation, the template's raise_exception) or answering an error
            request = ChatCompletionRequest(model="tiny", **copy.deepcopy(body))
            result = asyncio.run(renderer.render_chat(request))
        except (ValueError, TypeError, jinja2.TemplateError, VLLMClientError):
            return None
        if isinstance(result, ErrorResponse):
            return None
        _, [prompt] = result
        return prompt["prompt"], list(prompt["prompt_token_ids"])


@pytest.fixture(scope="module")
def vllm_reference() -> VllmReference:
    return VllmReference()


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("model", ["tiny", "llama3", "mistral", "chatml"])
def test_router_renders_chat_to_the_text_and_ids_vllm_computes(
    model_dirs, vllm_reference, model: str, case: str
) -> None:
    body = CASES[case]
    router = PromptTokenizer.load(str(model_dirs[model]))
    expected = vllm_reference.render(model_dirs[model], body)
    if expected is None:  # e.g. Mistral's template refusing a system message
        with pytest.raises(NotRendered) as refused:
            router.chat(body)
        assert refused.value.reason == "template_error"
        return
    text, ids = expected
    assert router.template is not None
    assert router.template.render(body)[0] == text
    assert router.chat(body) == ids
    assert router.text_off_gil(*router.chat_text(body)) == ids  # the long-prompt path


def test_every_case_is_rendered_by_vllm_somewhere(model_dirs, vllm_reference) -> None:
    """No case is vacuous: each one renders (and so compares ids) on at least one template,
    and the Mistral template really refuses what it refuses."""
    for case, body in CASES.items():
        assert any(vllm_reference.render(d, body) is not None for d in model_dirs.values()), case
    assert vllm_reference.render(model_dirs["mistral"], CASES["system+user"]) is None


@pytest.mark.parametrize("case", BASIC)
@pytest.mark.parametrize("model", ["tiny", "llama3", "chatml"])
def test_router_ids_equal_transformers_apply_chat_template(model_dirs, model: str, case: str) -> None:
    from transformers import AutoTokenizer

    body = CASES[case]
    reference = AutoTokenizer.from_pretrained(str(model_dirs[model])).apply_chat_template(
        body["messages"],
        tokenize=True,
        return_dict=False,
        add_generation_prompt=body.get("add_generation_prompt", True),
    )
    assert PromptTokenizer.load(str(model_dirs[model])).chat(body) == list(reference)


def test_a_wrong_rendering_changes_the_ids(model_dirs, vllm_reference) -> None:
    """Each mistake the renderer could make gives other ids than vLLM's, so the comparisons
    above would catch it: no trim_blocks/lstrip_blocks, the wrong content format, the
    special tokens missing, special tokens added again."""
    import jinja2.sandbox

    chatml = PromptTokenizer.load(str(model_dirs["chatml"]))
    assert chatml.template is not None and chatml.template.content_format == "openai"
    body = CASES["text-parts"]
    _, ids = vllm_reference.render(model_dirs["chatml"], body)
    assert chatml.chat(body) == ids
    right = chatml.template.compiled.environment
    untrimmed = jinja2.sandbox.ImmutableSandboxedEnvironment(extensions=[type(e) for e in right.extensions.values()])
    wrong = [
        ChatTemplate(CHATML, untrimmed.from_string(CHATML), "openai", chatml.template.special_tokens),
        ChatTemplate(CHATML, chatml.template.compiled, "string", chatml.template.special_tokens),
    ]
    for template in wrong:
        text, special = template.render(body)
        assert chatml.text(text, special) != ids

    llama3 = PromptTokenizer.load(str(model_dirs["llama3"]))
    assert llama3.template is not None
    body = CASES["system+user"]
    _, ids = vllm_reference.render(model_dirs["llama3"], body)
    no_bos = ChatTemplate(
        LLAMA3, llama3.template.compiled, "string", {**llama3.template.special_tokens, "bos_token": ""}
    )
    assert llama3.text(no_bos.render(body)[0], False) != ids
    assert llama3.text(llama3.template.render(body)[0], True) != ids  # BOS twice


def test_the_template_is_found_where_transformers_looks(model_dirs, tmp_path: Path) -> None:
    """chat_template.jinja over the config's entry; named templates' default; a bare
    tokenizer.json has none (chat then falls back); the config's special tokens, plain or
    serialized AddedTokens, model-specific `*_token` names included."""
    chatml = PromptTokenizer.load(str(model_dirs["chatml"]))
    assert chatml.template is not None and chatml.template.source == CHATML
    both = tmp_path / "both"
    shutil.copytree(model_dirs["mistral"], both)
    config = json.loads((both / "tokenizer_config.json").read_text())
    (both / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": "ignored"}))
    loaded = PromptTokenizer.load(str(both))
    assert loaded.template is not None and loaded.template.source == MISTRAL
    bare = PromptTokenizer.load(str(both / "tokenizer.json"))
    with pytest.raises(NotRendered) as missing:
        bare.chat(CASES["system+user"])
    assert missing.value.reason == "no_chat_template"
    assert bare.text("w1 w2", add_special_tokens=False) == loaded.text("w1 w2", add_special_tokens=False)
    assert special_tokens_of(
        {
            "bos_token": {"__type": "AddedToken", "content": "<s>"},
            "eos_token": "</s>",
            "pad_token": None,
            "image_token": "<img>",
            "add_bos_token": True,
            "extra_special_tokens": {"audio_token": "<aud>"},
        }
    ) == {"bos_token": "<s>", "eos_token": "</s>", "image_token": "<img>", "audio_token": "<aud>"}


@pytest.mark.parametrize(
    "body, reason",
    [
        ({"messages": [USER], "tools": [{"type": "function", "function": {"name": "f"}}]}, "unsupported_request"),
        ({"messages": [USER], "chat_template": "{{ 1 }}"}, "unsupported_request"),
        ({"messages": [USER], "chat_template_kwargs": {"chat_template": "{{ 1 }}"}}, "unsupported_request"),
        ({"messages": [USER], "chat_template_kwargs": {"tokenize": True}}, "unsupported_request"),
        ({"messages": [USER], "truncate_prompt_tokens": 5}, "unsupported_request"),
        ({"messages": [USER], "cache_salt": "abc"}, "unsupported_request"),
        ({"messages": [USER], "add_generation_prompt": True, "continue_final_message": True}, "unsupported_request"),
        (
            {
                "messages": [
                    USER,
                    {
                        "role": "assistant",
                        "content": None,
                        "tool_calls": [{"id": "1", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
                    },
                ]
            },
            "unsupported_message",
        ),
        ({"messages": [{"role": "tool", "content": "w1", "tool_call_id": "1"}]}, "unsupported_message"),
        ({"messages": [{"role": "developer", "content": "w1"}, USER]}, "unsupported_message"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
            "unsupported_message",
        ),
        (
            {"messages": [{"role": "system", "content": "x-anthropic-billing-header: cch=1\nw1"}, USER]},
            "unsupported_message",
        ),
    ],
)
def test_what_is_not_reproduced_is_refused_with_a_reason(model_dirs, body: dict[str, Any], reason: str) -> None:
    with pytest.raises(NotRendered) as refused:
        PromptTokenizer.load(str(model_dirs["chatml"])).chat(body)
    assert refused.value.reason == reason
