"""Named chat templates and their inverse parsers (TorchRL's ``chat_template_name`` values).

``History.apply_chat_template(chat_template_name=...)`` renders with one of these templates and
``History.from_text(text, chat_template_name=...)`` parses text in that format back into messages.
The names are TorchRL's: ``"chatml_format"``, ``"qwen"``, ``"dialogpt"``, ``"falcon"``,
``"deepseek"``, ``"llama"`` (Llama 4 headers); :func:`add_chat_template` registers more.

Every template wraps what the model generates (an assistant message's content and its end marker)
in ``{% generation %}`` so that ``return_assistant_tokens_mask=True`` works with any tokenizer.
Deliberate deviation from TorchRL's templates: the role header (``<|im_start|>assistant\\n``,
``Assistant: ``) stays outside the mask, because the template writes it, not the model; and no
stray indentation is rendered between messages.

Parsers return message dicts (``role``, ``content``, ``is_complete``) and keep every content
exactly as it appears in the text (TorchRL strips whitespace), so that rendering the parsed
messages gives the text back. A last message without its end marker is ``is_complete=False``.
Formats that drop information cannot give it back: DialoGPT renders neither roles nor system
messages (roles are recovered by alternation, user first), and a content that contains the
format's own separators (Falcon's ``"\\n\\nUser: "``) is split there.
"""

from __future__ import annotations

import re
from collections.abc import Callable

_IM_START, _IM_END, _ENDOFTEXT = "<|im_start|>", "<|im_end|>", "<|endoftext|>"
_TOOL_BLOCK = re.compile(r"<tool_response>\n(.*?)\n</tool_response>", re.DOTALL)

# Renders a message's content: a string as is, a list of blocks as its text blocks joined.
_TEXT_MACRO = (
    "{%- macro text(content) -%}{%- if content is string -%}{{ content }}{%- else -%}"
    "{%- for block in content -%}{%- if block['type'] == 'text' -%}{{ block['text'] }}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}{%- endmacro -%}"
)

_CHATML = _TEXT_MACRO + (
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'assistant' -%}"
    "{{ '<|im_start|>assistant\\n' }}{% generation %}{{ text(message['content']) }}{{ '<|im_end|>' }}"
    "{% endgeneration %}{{ '\\n' }}"
    "{%- else -%}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}{{ text(message['content']) }}{{ '<|im_end|>\\n' }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)

# Qwen2.5's format: a default system prompt, tools in the system message, tool calls as
# <tool_call> JSON, consecutive tool messages grouped in one user turn of <tool_response> blocks.
_QWEN = _TEXT_MACRO + (
    "{%- if tools -%}"
    "{{ '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' -%}{{ text(messages[0]['content']) }}"
    "{%- else -%}{{ 'You are a helpful assistant.' }}{%- endif -%}"
    "{{ '\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools -%}{{ '\\n' }}{{ tool | tojson }}{%- endfor -%}"
    "{{ '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments "
    'within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{"name": <function-name>, "arguments": '
    "<args-json-object>}\\n</tool_call><|im_end|>\\n' }}"
    "{%- elif messages[0]['role'] != 'system' -%}"
    "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}"
    "{%- if not (loop.first and tools) -%}"
    "{{ '<|im_start|>system\\n' }}{{ text(message['content']) }}{{ '<|im_end|>\\n' }}"
    "{%- endif -%}"
    "{%- elif message['role'] == 'assistant' -%}"
    "{{ '<|im_start|>assistant\\n' }}{% generation %}{{ text(message['content']) }}"
    "{%- for call in (message['tool_calls'] or []) -%}"
    "{%- if call['function'] is defined -%}{%- set call = call['function'] -%}{%- endif -%}"
    "{%- if not loop.first or message['content'] -%}{{ '\\n' }}{%- endif -%}"
    "{{ '<tool_call>\\n{\"name\": \"' + call['name'] + '\", \"arguments\": ' }}{{ call['arguments'] | tojson }}"
    "{{ '}\\n</tool_call>' }}"
    "{%- endfor -%}"
    "{{ '<|im_end|>' }}{% endgeneration %}{{ '\\n' }}"
    "{%- elif message['role'] == 'tool' -%}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' -%}{{ '<|im_start|>user' }}{%- endif -%}"
    "{%- for response in (message['tool_responses'] or [message['content']]) -%}"
    "{{ '\\n<tool_response>\\n' }}{{ text(response) }}{{ '\\n</tool_response>' }}"
    "{%- endfor -%}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' -%}{{ '<|im_end|>\\n' }}{%- endif -%}"
    "{%- else -%}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}{{ text(message['content']) }}{{ '<|im_end|>\\n' }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)

# DialoGPT: each user or assistant message followed by the EOS token; system messages dropped.
_DIALOGPT = _TEXT_MACRO + (
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'assistant' -%}"
    "{% generation %}{{ text(message['content']) }}{{ eos_token }}{% endgeneration %}"
    "{%- elif message['role'] == 'user' -%}{{ text(message['content']) }}{{ eos_token }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ ' ' }}{%- endif -%}"
)

_FALCON = _TEXT_MACRO + (
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'assistant' -%}"
    "{{ 'Assistant: ' }}{% generation %}{{ text(message['content']) }}{% endgeneration %}{{ '\\n\\n' }}"
    "{%- elif message['role'] == 'user' -%}{{ 'User: ' }}{{ text(message['content']) }}{{ '\\n\\n' }}"
    "{%- elif message['role'] == 'system' -%}{{ text(message['content']) }}{{ '\\n\\n' }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ 'Assistant: ' }}{%- endif -%}"
)

_DEEPSEEK = _TEXT_MACRO + (
    "{{ bos_token }}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'user' -%}{{ 'User: ' }}{{ text(message['content']) }}{{ '\\n\\n' }}"
    "{%- elif message['role'] == 'assistant' -%}"
    "{{ 'Assistant: ' }}{% generation %}{{ text(message['content']) }}{{ eos_token }}{% endgeneration %}"
    "{%- elif message['role'] == 'system' -%}{{ text(message['content']) }}{{ '\\n\\n' }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ 'Assistant:' }}{%- endif -%}"
)

# Llama 4 headers: <|header_start|>role<|header_end|>\n\ncontent<|eot|>
_LLAMA = _TEXT_MACRO + (
    "{{ bos_token }}"
    "{%- for message in messages -%}"
    "{{ '<|header_start|>' + message['role'] + '<|header_end|>\\n\\n' }}"
    "{%- if message['role'] == 'assistant' -%}"
    "{% generation %}{{ text(message['content']) }}{{ '<|eot|>' }}{% endgeneration %}"
    "{%- else -%}{{ text(message['content']) }}{{ '<|eot|>' }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|header_start|>assistant<|header_end|>\\n\\n' }}{%- endif -%}"
)

# Special tokens the parsers assume when no tokenizer is given (each family's own).
_DEFAULT_TOKENS = {
    "dialogpt": {"bos_token": "", "eos_token": "<|endoftext|>"},
    "deepseek": {"bos_token": "<｜begin▁of▁sentence｜>", "eos_token": "<｜end▁of▁sentence｜>"},
    "llama": {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot|>"},
}


# ---------------------------------------------------------------------------------- parsers


def parse_chatml(text: str) -> list[dict]:
    """Message dicts (``role``, ``content``, ``is_complete``) of a rendered ChatML / Qwen text.

    A last block cut before its ``<|im_end|>`` is ``is_complete=False``; one the next
    ``<|im_start|>`` follows ends there, complete, minus a closing ``<|endoftext|>``. A turn made
    only of ``<tool_response>`` blocks (Qwen's tool messages) gives one ``"tool"`` message per
    block. Text after an ``<|im_end|>`` that opens no block (what vLLM generates with
    ``ignore_eos=True``) is dropped, as TorchRL drops it; text before the first block is an error.
    """
    messages: list[dict] = []
    pos = 0
    while True:
        start = text.find(_IM_START, pos)
        junk = text[pos:] if start < 0 else text[pos:start]
        if junk.strip() and not messages:
            raise ValueError(f"from_text: text before the first <|im_start|> block: {junk[:80]!r}")
        if start < 0:
            break
        header_end = text.find("\n", start)
        if header_end < 0:  # "<|im_start|>assistant" with no newline yet: an open, empty turn
            role, body_start = text[start + len(_IM_START) :], len(text)
        else:
            role, body_start = text[start + len(_IM_START) : header_end], header_end + 1
        end, next_start = text.find(_IM_END, body_start), text.find(_IM_START, body_start)
        if end >= 0 and (next_start < 0 or end < next_start):
            content, complete, pos = text[body_start:end], True, end + len(_IM_END)
        elif next_start >= 0:
            content, complete, pos = text[body_start:next_start].rstrip("\n"), True, next_start
            content = content[: -len(_ENDOFTEXT)] if content.endswith(_ENDOFTEXT) else content
        else:
            content, complete, pos = text[body_start:], False, len(text)
        messages.extend(_chatml_message(role, content, complete))
    if not messages:
        raise ValueError(f"from_text: no <|im_start|> message found in {text[:80]!r}")
    return messages


def _chatml_message(role: str, content: str, complete: bool) -> list[dict]:
    if role in ("user", "tool") and complete:
        responses = _tool_responses(content)
        if responses is not None:
            return [{"role": "tool", "content": r, "is_complete": True} for r in responses]
    return [{"role": role, "content": content, "is_complete": complete}]


def _tool_responses(content: str) -> list[str] | None:
    """The responses of a turn made only of ``<tool_response>`` blocks, else None."""
    blocks = list(_TOOL_BLOCK.finditer(content))
    if not blocks or "\n".join(m.group(0) for m in blocks) != content:
        return None
    return [m.group(1) for m in blocks]


def _parse_dialogpt(text: str, tokens: dict) -> list[dict]:
    eos = tokens["eos_token"]
    pieces = text.split(eos) if eos else [text]
    messages = []
    for i, piece in enumerate(pieces):
        last = i == len(pieces) - 1
        if last and piece == "":
            break
        role = "user" if i % 2 == 0 else "assistant"
        messages.append({"role": role, "content": piece, "is_complete": not last})
    return messages


_FALCON_TURN = re.compile(r"(?:^|(?<=\n\n))(User|Assistant): ")


def _parse_falcon(text: str, tokens: dict) -> list[dict]:
    turns = list(_FALCON_TURN.finditer(text))
    messages = []
    system_end = turns[0].start() if turns else len(text)
    for system in filter(None, text[:system_end].split("\n\n")):
        messages.append({"role": "system", "content": system, "is_complete": True})
    for i, turn in enumerate(turns):
        end = turns[i + 1].start() if i + 1 < len(turns) else len(text)
        body = text[turn.end() : end]
        complete = body.endswith("\n\n")
        messages.append(
            {"role": turn.group(1).lower(), "content": body[:-2] if complete else body, "is_complete": complete}
        )
    return messages


def _parse_deepseek(text: str, tokens: dict) -> list[dict]:
    bos, eos = tokens["bos_token"], tokens["eos_token"]
    text = text[len(bos) :] if bos and text.startswith(bos) else text
    messages, pos = [], 0
    while pos < len(text):
        if text.startswith("User: ", pos):
            end = text.find("\n\n", pos + 6)
            role, body_start, marker = "user", pos + 6, "\n\n"
        elif text.startswith("Assistant:", pos):
            body_start = pos + len("Assistant: " if text.startswith("Assistant: ", pos) else "Assistant:")
            end = text.find(eos, body_start) if eos else -1
            role, marker = "assistant", eos
        else:
            end = text.find("\n\n", pos)
            role, body_start, marker = "system", pos, "\n\n"
        complete = end >= 0
        content = text[body_start:end] if complete else text[body_start:]
        messages.append({"role": role, "content": content, "is_complete": complete})
        pos = end + len(marker) if complete else len(text)
    return messages


_LLAMA_HEADER = re.compile(r"<\|header_start\|>(\w+)<\|header_end\|>\n\n")


def _parse_llama(text: str, tokens: dict) -> list[dict]:
    bos = tokens["bos_token"]
    text = text[len(bos) :] if bos and text.startswith(bos) else text
    headers = list(_LLAMA_HEADER.finditer(text))
    if headers and text[: headers[0].start()].strip():
        raise ValueError(f"from_text: text before the first Llama header: {text[:80]!r}")
    messages = []
    for i, header in enumerate(headers):
        end = headers[i + 1].start() if i + 1 < len(headers) else len(text)
        body = text[header.end() : end]
        complete = body.endswith("<|eot|>")
        content = body[: -len("<|eot|>")] if complete else body
        messages.append({"role": header.group(1), "content": content, "is_complete": complete})
    return messages


# ---------------------------------------------------------------------------------- registry

CHAT_TEMPLATES: dict[str, str] = {
    "chatml_format": _CHATML,
    "qwen": _QWEN,
    "dialogpt": _DIALOGPT,
    "falcon": _FALCON,
    "deepseek": _DEEPSEEK,
    "llama": _LLAMA,
}
_PARSERS: dict[str, Callable[[str, dict], list[dict]]] = {
    "chatml_format": lambda text, tokens: parse_chatml(text),
    "qwen": lambda text, tokens: parse_chatml(text),
    "dialogpt": _parse_dialogpt,
    "falcon": _parse_falcon,
    "deepseek": _parse_deepseek,
    "llama": _parse_llama,
}
# Built-in families, checked in this order against the tokenizer's name_or_path (lowercased).
_FAMILY_KEYWORDS: list[tuple[str, tuple[str, ...]]] = [
    ("qwen", ("qwen",)),
    ("dialogpt", ("dialogpt", "microsoft/dialo")),
    ("falcon", ("falcon", "tiiuae/falcon")),
    ("deepseek", ("deepseek",)),
    ("llama", ("llama",)),
]
_CUSTOM_PARSERS: dict[str, Callable] = {}
_CUSTOM_KEYWORDS: dict[str, list[str]] = {}


def add_chat_template(
    template_name: str,
    template: str,
    inverse_parser: Callable | None = None,
    model_family_keywords: list[str] | None = None,
) -> None:
    """Register a chat template under ``template_name`` (TorchRL's ``add_chat_template``).

    ``template`` must mark the assistant's tokens with ``{% generation %}`` (checked).
    ``inverse_parser(text) -> History`` serves ``from_text``; ``model_family_keywords``
    (case-insensitive, against ``name_or_path``) pick the template for matching tokenizers.
    Registrations last for the process.
    """
    if "{% generation %}" not in template:
        raise ValueError(
            f"template {template_name!r} must mark the assistant's tokens with '{{% generation %}}' blocks "
            "so that assistant token masks work"
        )
    CHAT_TEMPLATES[template_name] = template
    if inverse_parser is not None:
        _CUSTOM_PARSERS[template_name] = inverse_parser
    if model_family_keywords is not None:
        _CUSTOM_KEYWORDS[template_name] = [keyword.lower() for keyword in model_family_keywords]


def custom_template_name(tokenizer) -> str | None:
    """The registered custom template whose keywords match the tokenizer's name, if any."""
    model_name = (getattr(tokenizer, "name_or_path", "") or "").lower()
    for name, keywords in _CUSTOM_KEYWORDS.items():
        if any(keyword in model_name for keyword in keywords):
            return name
    return None


def detect_chat_template_name(tokenizer) -> str:
    """TorchRL's model-family detection: the template name for a tokenizer's ``name_or_path``.

    Custom templates registered with keywords come first, then Qwen, DialoGPT, Falcon, DeepSeek
    and Llama; anything else (or no tokenizer) is ``"chatml_format"``.
    """
    custom = custom_template_name(tokenizer)
    if custom is not None:
        return custom
    model_name = (getattr(tokenizer, "name_or_path", "") or "").lower()
    for name, keywords in _FAMILY_KEYWORDS:
        if any(keyword in model_name for keyword in keywords):
            return name
    return "chatml_format"


def chat_template(name: str) -> str:
    """The Jinja template registered under ``name``."""
    if name not in CHAT_TEMPLATES:
        raise ValueError(f"unknown chat_template_name {name!r}; known: {sorted(CHAT_TEMPLATES)}")
    return CHAT_TEMPLATES[name]


def parse_text(text: str, name: str, tokenizer=None):
    """Parse one rendered text in the ``name`` format: message dicts, or whatever a custom
    ``inverse_parser`` returns (a History)."""
    if name in _CUSTOM_PARSERS:
        return _CUSTOM_PARSERS[name](text)
    if name not in _PARSERS:
        raise NotImplementedError(
            f"chat_template_name {name!r} has no parser; supported: {sorted(set(_PARSERS) | set(_CUSTOM_PARSERS))}. "
            "Register one with add_chat_template(..., inverse_parser=...)."
        )
    tokens = dict(_DEFAULT_TOKENS.get(name, {}))
    for key in tokens:
        value = getattr(tokenizer, key, None) if tokenizer is not None else None
        if value is not None:
            tokens[key] = value
    messages = _PARSERS[name](text, tokens)
    if not messages:
        raise ValueError(f"from_text: no {name} message found in {text[:80]!r}")
    return messages


def resolve_template(tokenizer, template: str | None, template_name: str | None) -> str | None:
    """The Jinja template a chat renders with (``apply_chat_template``'s ``chat_template`` and
    ``chat_template_name``); None means the tokenizer's own."""
    if template is not None:
        return template
    if template_name is not None:
        return chat_template(template_name)
    custom = custom_template_name(tokenizer)
    if custom is not None:
        return chat_template(custom)
    if not getattr(tokenizer, "chat_template", None):
        return chat_template("chatml_format")
    return None
