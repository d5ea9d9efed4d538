"""Routes other engines' clients look for: vLLM's `GET /tokenizer_info` (lm-evaluation-harness's
local-completions then tokenizes through the server's /tokenize with no local tokenizer) and
OpenAI's `GET /v1/models/{model}`."""

from __future__ import annotations

import time

from fastapi import FastAPI
from pydantic import BaseModel

from tokenmill.entrypoints.openai import openapi
from tokenmill.entrypoints.openai.http_errors import clip
from tokenmill.entrypoints.openai.openapi import ModelCard
from tokenmill.errors import ModelNotFoundError


class TokenizerInfo(BaseModel):
    tokenizer_class: str
    eos_token: str | None
    bos_token: str | None
    pad_token: str | None
    unk_token: str | None
    chat_template: str | None
    model_max_length: int
    add_bos_token: bool | None


def register_compat_routes(app: FastAPI, state) -> None:
    @app.get("/tokenizer_info", response_model=TokenizerInfo, responses=openapi.errors(401, 500, 503))
    async def tokenizer_info():
        engine = state.ready()
        tok = engine.tokenizer
        return {"tokenizer_class": type(tok).__name__, "eos_token": tok.eos_token, "bos_token": tok.bos_token,
                "pad_token": tok.pad_token, "unk_token": getattr(tok, "unk_token", None),
                "chat_template": engine.chat_template, "model_max_length": engine.max_model_len,
                "add_bos_token": getattr(tok, "add_bos_token", None)}

    @app.get("/v1/models/{model_id:path}", response_model=ModelCard, responses=openapi.errors(401, 404, 500, 503))
    async def retrieve_model(model_id: str):
        engine = state.ready()
        if model_id != state.model_name:
            raise ModelNotFoundError(f"The model `{clip(model_id)}` does not exist; this server serves "
                                     f"`{state.model_name}`.")
        return {"id": state.model_name, "object": "model", "created": int(time.time()), "owned_by": "tokenmill",
                "root": state.model_name, "max_model_len": engine.max_model_len}
