"""What tells a completion from a chat completion in a response: the object names, a choice's text or message, a
stream chunk's delta, and the logprobs' form. The rest of a response (sequences, streaming, usage) is shared."""

from __future__ import annotations

from overlap.openai.text import TextProcessor
from overlap.sidecar.logprobs import chat_logprobs, completion_logprobs


class CompletionShape:
    object = "text_completion"
    chunk_object = "text_completion"
    id_prefix = "cmpl"
    opens_with_role = False  # a chat stream's first chunk names the role

    def logprobs(self, text: TextProcessor, token_ids: list[int], logprobs: list | None,
                 offset: int) -> tuple[dict, int]:  # fmt: skip
        """The logprobs object of these tokens, and the text offset after them (completions count offsets)."""
        lp = completion_logprobs(text, token_ids, logprobs, offset)
        return lp, offset + sum(len(t) for t in lp["tokens"])

    def choice(self, index: int, text: str, logprobs: dict | None, finish_reason: str | None,
               tool_calls: list[dict] | None = None) -> dict:  # fmt: skip
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}

    def chunk_choice(self, index: int, text: str | None, logprobs: dict | None, finish_reason: str | None,
                     first: bool = False) -> dict:  # fmt: skip
        return {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish_reason}


class ChatShape(CompletionShape):
    object = "chat.completion"
    chunk_object = "chat.completion.chunk"
    id_prefix = "chatcmpl"
    opens_with_role = True

    def logprobs(self, text, token_ids, logprobs, offset):
        return chat_logprobs(text, token_ids, logprobs), offset

    def choice(self, index, text, logprobs, finish_reason, tool_calls=None):
        message = {"role": "assistant", "content": text}
        if tool_calls:
            message["tool_calls"] = tool_calls
        return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish_reason}

    def chunk_choice(self, index, text, logprobs, finish_reason, first=False):
        delta = {"role": "assistant", "content": text or ""} if first else ({"content": text} if text else {})
        return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}


COMPLETION = CompletionShape()
CHAT = ChatShape()
