"""The plugin in vLLM's API server: each request's ``kvcompress`` settings checked before the engine sees them, and
where its question begins told to the engine."""

from __future__ import annotations

import functools
import json
import os
from typing import Any

from transformers import AutoTokenizer

from ..methods.fields import InvalidParameterError
from .settings import (
    ENGINE_ENV,
    FIELD,
    QUESTION_START,
    chat_question_start,
    check_question_start,
    method_of,
    model_config,
    question_start_of,
    scorable,
)


class RequestSettings:
    """An ASGI middleware of vLLM's API server (``--middleware``): a request body's ``kvcompress``
    settings are checked by the library's own validation (an HTTP 400 naming the field and its valid
    values otherwise, the server serving on) and passed to the engine in the request's ``vllm_xargs``, with where
    its question begins: as the request says (``question_start``), else, for a chat whose method reads it, where
    its conversation begins (``settings.chat_question_start``)."""

    def __init__(self, app: Any) -> None:
        self.app = app
        engine = json.loads(os.environ.get(ENGINE_ENV) or "{}")  # where ``kvcompress serve`` started the server:
        self.pool = engine.get("kv_cache_dtype")  # its cache pool's dtype (None: the model's)
        self.default = method_of(engine[FIELD], cache_dtype=self.pool) if FIELD in engine else None  # its method
        self.config = model_config(engine["model"]) if "model" in engine else None  # and its model's
        self.model = engine.get("model")  # (its tokenizer read on first need)

    @functools.cached_property
    def tokenizer(self) -> Any:
        return AutoTokenizer.from_pretrained(self.model)

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["method"] != "POST":
            return await self.app(scope, receive, send)
        body, more = b"", True
        while more:
            message = await receive()
            body, more = body + message.get("body", b""), message.get("more_body", False)
        try:
            payload = json.loads(body) if body else None
        except ValueError:
            payload = None  # not JSON: vLLM answers it
        chat = scope.get("path", "").endswith("/chat/completions") and self.model is not None
        if isinstance(payload, dict) and (FIELD in payload or chat):
            try:
                settings = self.engine_settings(payload, chat)
            except InvalidParameterError as err:
                return await bad_request(send, str(err))
            if settings:
                payload["vllm_xargs"] = {**(payload.get("vllm_xargs") or {}), FIELD: json.dumps(settings)}
            body = json.dumps(payload).encode()
            headers = [(k, v) for k, v in scope["headers"] if k.lower() != b"content-length"]
            scope = {**scope, "headers": [*headers, (b"content-length", str(len(body)).encode())]}
        replayed = False

        async def replay() -> dict:
            nonlocal replayed
            if replayed:
                return await receive()  # a disconnect, as vLLM waits for it
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)

    def engine_settings(self, payload: dict, chat: bool) -> dict[str, Any]:
        """What the engine gets of a request body (its ``kvcompress`` field taken out): its method's settings where it
        names any (validated), and where its question begins where that is known and its method reads it."""
        settings, start = question_start_of(payload.pop(FIELD, None))
        named = settings is not None and settings != {}
        method = scorable(method_of(settings, self.default, self.pool), self.config) if named else self.default
        engine: dict[str, Any] = {"method": method.name, **method.settings()} if named and method is not None else {}
        if self.model is None:  # (a middleware outside ``kvcompress serve``: no tokenizer to check the start with)
            return {**engine, QUESTION_START: start} if start is not None else engine
        if start is not None:  # named by the request: checked against its prompt
            for prompt in self.prompt_tokens(payload, chat):
                check_question_start(start, prompt)
        elif (
            chat
            and self.rendered_as_vllm(payload)
            and method is not None
            and (method.queries_needed(1) != method.queries_needed())
        ):  # (a method the start changes nothing for: none)
            start = chat_question_start(self.tokenizer, payload["messages"], **self.template(payload))
        return {**engine, QUESTION_START: start} if start is not None else engine

    @staticmethod
    def rendered_as_vllm(payload: dict) -> bool:
        """Whether this server renders a chat request's messages as vLLM will: text messages, no tools, no template of
        the request's own."""
        messages = payload.get("messages")
        return (
            isinstance(messages, list)
            and "tools" not in payload
            and "chat_template" not in payload
            and all(isinstance(m, dict) and isinstance(m.get("content"), str) for m in messages)
        )

    @staticmethod
    def template(payload: dict) -> dict[str, Any]:
        """The chat template's arguments a chat request sets, as vLLM renders it."""
        return {
            "add_generation_prompt": payload.get("add_generation_prompt", True),
            **(payload.get("chat_template_kwargs") or {}),
        }

    def prompt_tokens(self, payload: dict, chat: bool) -> list[int]:
        """The token counts of a request's prompts, where this server's tokenizer tells them as vLLM will: a chat
        rendered by the model's template (none for tools or a template of the request's own), a completion's text
        or token ids."""
        if chat:
            if not self.rendered_as_vllm(payload):
                return []
            text = self.tokenizer.apply_chat_template(payload["messages"], tokenize=False, **self.template(payload))
            return [len(self.tokenizer(text, add_special_tokens=False)["input_ids"])]
        prompt = payload.get("prompt")
        prompts = prompt if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int) else [prompt]
        return [
            len(p) if isinstance(p, list) else len(self.tokenizer(p)["input_ids"])
            for p in prompts
            if isinstance(p, (str, list))
        ]


async def bad_request(send: Any, message: str) -> None:
    """An HTTP 400 in the OpenAI error format."""
    body = json.dumps({"error": {"message": message, "type": "BadRequestError", "param": FIELD, "code": 400}}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": 400, "headers": headers})
    await send({"type": "http.response.body", "body": body})
