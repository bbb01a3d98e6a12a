"""The public port's API: OpenAI's completions, chat completions and models, vLLM's tokenize routes, the probes.

One module per endpoint (`completions`, `chat`, `models`, `lora`, `tokenize`, `health`, `kv_events`: what a router
reads), with the shared parts beside them: `request` (OpenAI request -> prompt ids and SamplingParams), `serving` (a
request's sequences in the engine), `collect` and `stream` (whole and streamed answers), `shape` (what differs
between completion and chat responses), `sequences` (the records they share).
"""

from __future__ import annotations

from overlap.openai import schemas
from overlap.sidecar.openai.chat import chat_completions
from overlap.sidecar.openai.completions import completions
from overlap.sidecar.openai.health import healthz, readyz, version
from overlap.sidecar.openai.kv_events import kv_events
from overlap.sidecar.openai.lora import load_lora_adapter, unload_lora_adapter
from overlap.sidecar.openai.models import list_models
from overlap.sidecar.openai.tokenize import detokenize, tokenize, tokenizer_files

# (method, path, summary for the OpenAPI document, handler, request body type)
ROUTES = [
    ("POST", "/v1/completions", "Create a text completion (OpenAI-compatible; stream for SSE)", completions,
     schemas.CompletionRequest),
    ("POST", "/v1/chat/completions", "Create a chat completion (OpenAI-compatible; stream for SSE)",
     chat_completions, schemas.ChatCompletionRequest),
    ("GET", "/v1/models", "List the served model and its LoRA adapters", list_models, None),
    ("POST", "/v1/load_lora_adapter", "Load a LoRA adapter (PEFT folder) into the engine (vLLM's; needs "
     "--allow-runtime-lora-updating)", load_lora_adapter, schemas.LoadLoraAdapterRequest),
    ("POST", "/v1/unload_lora_adapter", "Unload a LoRA adapter; its requests finish first (vLLM's; needs "
     "--allow-runtime-lora-updating)", unload_lora_adapter, schemas.UnloadLoraAdapterRequest),
    ("POST", "/tokenize", "Token ids of a prompt or chat messages (vLLM's shape)", tokenize, schemas.TokenizeRequest),
    ("POST", "/detokenize", "Text of token ids (vLLM's shape)", detokenize, schemas.DetokenizeRequest),
    ("GET", "/version", "The server's version", version, None),
    ("GET", "/v1/tokenizer", "The tokenizer's files, base64 (for a router that scores prompts by tokens)",
     tokenizer_files, None),
    ("GET", "/v1/kv-events", "The prefix cache's added and evicted block hashes and the load (for a router)",
     kv_events, None),
    ("GET", "/health", "200 when requests can be served (for load generators)", readyz, None),
    ("GET", "/ping", "200 when requests can be served (vLLM's and SageMaker's probe)", readyz, None),
    ("POST", "/ping", "200 when requests can be served (vLLM's and SageMaker's probe)", readyz, None),
    ("GET", "/healthz", "Liveness: the sidecar answers", healthz, None),
    ("GET", "/readyz", "Readiness: engine connected, tokenizer loaded, not draining", readyz, None),
]  # fmt: skip
