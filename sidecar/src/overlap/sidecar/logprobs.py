"""The engine's token log-probabilities in OpenAI's two response shapes: completions' parallel lists
(`tokens`, `token_logprobs`, `top_logprobs`, `text_offset`) and chat's `content` list of objects."""

from __future__ import annotations

from overlap.openai.text import TextProcessor


def _split(lp) -> tuple[float | None, list]:
    """(logprob, top) from the wire's (logprob, [[id, logprob], ...]) or None (the runner had none)."""
    return (None, []) if lp is None else (lp[0], lp[1])


def completion_logprobs(text: TextProcessor, token_ids: list[int], logprobs: list | None, offset: int) -> dict:
    """OpenAI's completions `logprobs` object for these tokens (`logprobs` as the engine's wire output carries
    them); `offset` is the first token's text offset."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for token, lp in zip(token_ids, logprobs or [None] * len(token_ids), strict=True):
        piece = text.token_text(token)
        out["tokens"].append(piece)
        value, top = _split(lp)
        out["token_logprobs"].append(value)
        out["top_logprobs"].append(None if lp is None else {text.token_text(t): v for t, v in top})
        out["text_offset"].append(offset)
        offset += len(piece)
    return out


def chat_logprobs(text: TextProcessor, token_ids: list[int], logprobs: list | None) -> dict:
    """OpenAI's chat `logprobs` object (`{"content": [...]}`) for these tokens."""

    def entry(token: int, value: float | None) -> dict:
        piece = text.token_text(token)
        return {"token": piece, "logprob": value, "bytes": list(piece.encode())}

    content = []
    for token, lp in zip(token_ids, logprobs or [None] * len(token_ids), strict=True):
        value, top = _split(lp)
        item = entry(token, value)
        item["top_logprobs"] = [entry(t, v) for t, v in top]
        content.append(item)
    return {"content": content}
