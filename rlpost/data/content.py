"""ContentBase: one block of a multimodal message (TorchRL's ``torchrl.data.llm.history.ContentBase``).

A multimodal message's content is a stack of blocks, one batch dim more than its
:class:`~rlpost.data.History` message: ``lazy_stack([ContentBase(type="image", url=...),
ContentBase(type="text", text="What is this?")])``. Rendered, each block is the dict a chat
template or processor reads, so messages render through the tokenizer's or processor's template.
"""

from __future__ import annotations

from typing import Literal

from tensordict import TensorClass


# "shadow": the field names type/size/data/name would otherwise clash with TensorDict attributes.
class ContentBase(TensorClass["nocast", "shadow"]):
    """One content block of a message; every field but ``type`` is optional and defaults to None.

    Fields:
        type: "text", "image", "audio", "video", "file" or "function_call".
        text: the text of a "text" block.
        url: where the media lives (HTTP URL or path); ``data``: the media itself, base64-encoded.
        mime_type: e.g. "image/jpeg"; name: a file name or description; size: bytes.
        function_name, function_args: a "function_call" block's call.
    """

    type: Literal["text", "image", "audio", "video", "file", "function_call"]
    text: str | None = None
    url: str | None = None
    data: str | None = None
    mime_type: str | None = None
    name: str | None = None
    size: int | None = None
    function_name: str | None = None
    function_args: dict | None = None

    def to_blocks(self) -> list[dict] | dict:
        """The block dicts chat templates read (None fields omitted): a list for a ``[k]`` batch."""
        raw = self.tolist()
        if isinstance(raw, dict):
            return _clean_block(raw)
        return [_clean_block(block) for block in raw]


def _clean_block(block: dict) -> dict:
    # A field set on some blocks of a stack reads None on the others: drop those, "type" first.
    out = {"type": block["type"]}
    out.update((key, value) for key, value in block.items() if key != "type" and value is not None)
    return out


def is_content_blocks(content) -> bool:
    """Whether a message's ``content`` is a list of block dicts (OpenAI / transformers style)."""
    return isinstance(content, list) and all(isinstance(block, dict) for block in content)


def blocks_to_content(blocks: list[dict]) -> ContentBase:
    """A ``[len(blocks)]`` ContentBase from block dicts such as ``{"type": "text", "text": "hi"}``."""
    if not blocks:
        raise ValueError("a message's content blocks cannot be empty")
    fields = set(ContentBase.__dataclass_fields__)
    for block in blocks:
        if "type" not in block:
            raise ValueError(f"a content block needs a 'type', got keys {sorted(block)}")
        unknown = set(block) - fields
        if unknown:
            raise ValueError(f"unknown content block keys {sorted(unknown)}; known: {sorted(fields)}")
    columns = {name: [block.get(name) for block in blocks] for name in fields}
    present = {name: values for name, values in columns.items() if any(v is not None for v in values)}
    return ContentBase(**present, batch_size=[len(blocks)])
