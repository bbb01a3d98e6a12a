"""What the sidecar's handlers share, under typed AppKeys: the server state and the error type clients see (the
bearer-token check is `overlap.openai.auth`'s). One request's generation core is in `generation.py`."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from aiohttp import web
from prometheus_client import CollectorRegistry

from overlap.engine.serving.client import EngineClient
from overlap.openai.text import TextProcessor
from overlap.sidecar.admission import Admission
from overlap.sidecar.config import SidecarConfig
from overlap.sidecar.metrics import SidecarMetrics


class ApiError(Exception):
    """An error for the client, rendered as OpenAI's error object by the error middleware."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        *,
        code: str | None = None,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type = status, message, type
        self.code, self.param, self.headers = code, param, headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def engine_unavailable(message: str = "the engine is not available; retry shortly") -> ApiError:
    return ApiError(503, message, "service_unavailable", code="engine_unavailable", headers={"Retry-After": "1"})


@dataclass
class ServerState:
    config: SidecarConfig
    registry: CollectorRegistry
    metrics: SidecarMetrics
    admission: Admission
    client: EngineClient
    text: TextProcessor | None = None  # loaded from the engine's model folder on first connection
    text_preload: asyncio.Future | None = None  # with --tokenizer: loading since start-up
    max_model_len: int = 0  # from the engine's last Hello, kept while it is away
    quantization: str = ""  # the checkpoint's quantization format, likewise ("" for float weights)
    vocab_size: int = 0
    num_priority_levels: int = 1
    model_name: str = ""
    sampling_defaults: dict = field(default_factory=dict)  # the model's generation_config.json, from the Hello
    draining: bool = False
    applied_config: dict = field(default_factory=dict)  # the engine config after the last live change
    lora_adapters: dict[str, str] = field(default_factory=dict)  # LoRA adapter name -> folder, as the engine has them

    @property
    def ready(self) -> bool:
        return self.client.connected and self.text is not None and not self.draining

    def check_accepting(self) -> None:
        if self.draining:
            self.metrics.rejected_by["draining"].inc()
            raise ApiError(503, "the server is shutting down", "service_unavailable", code="draining")
        if self.text is None or not self.client.connected:
            self.metrics.rejected_by["engine_unavailable"].inc()
            raise engine_unavailable()


STATE = web.AppKey("state", ServerState)
