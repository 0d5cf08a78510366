"""OpenAI API request bodies (the subset we serve) as pydantic models, and the error body.

Unknown fields are rejected rather than ignored: a client that sends `logprobs` or `n=3` should
learn that it did not get them. Types are strict, as OpenAI's: `"max_tokens": "4"` is an error, not 4.
Text must be valid Unicode (a lone surrogate such as "\\ud800" is refused). `top_k` and `coupling` are
extensions (the `openai` client sends them through `extra_body`).
"""

from __future__ import annotations

from typing import Annotated, Literal, cast

from pydantic import BaseModel, ConfigDict, Field, WithJsonSchema, field_validator, model_validator

from specdecode.serving.limits import MAX_STOP_CHARACTERS, MAX_STOP_STRINGS
from specdecode.verification.sampling import COUPLINGS



class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    @model_validator(mode="after")
    def _valid_unicode(self):
        _check_unicode(self.model_dump(), "")
        return self


def _check_unicode(value: object, where: str) -> None:
    """Refuse text that cannot be encoded as UTF-8 (lone surrogates), naming the field."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise ValueError(f"{where or 'a field'} holds a lone surrogate ({value[exc.start]!r} at character "
                             f"{exc.start}); send valid Unicode") from None
    elif isinstance(value, dict):
        for key, item in value.items():
            _check_unicode(item, f"{where}.{key}" if where else key)
    elif isinstance(value, list):
        for i, item in enumerate(value):
            _check_unicode(item, f"{where}[{i}]")


class StreamOptions(_Strict):
    include_usage: bool = False


class _Sampling(_Strict):

    model: str | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] = 1.0  # OpenAI's default and range
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
    top_k: Annotated[int, Field(ge=0)] = 0  # extension; 0 = off
    seed: Annotated[int, Field(ge=0, lt=2**63)] | None = None
    stop: str | list[str] | None = Field(None, validate_default=True)
    n: Literal[1] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    coupling: Literal[COUPLINGS] = "rejection"  # type: ignore[valid-type]  # extension, see `--coupling`

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, v: str | list[str] | None) -> list[str]:
        stops = [] if v is None else [v] if isinstance(v, str) else v
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings")
        if any(not s for s in stops):
            raise ValueError("stop strings must not be empty")
        if sum(len(s) for s in stops) > MAX_STOP_CHARACTERS:
            raise ValueError(f"the stop strings hold more than {MAX_STOP_CHARACTERS} characters in all")
        return stops


class CompletionRequest(_Sampling):
    prompt: Annotated[str | list[int] | list[str], WithJsonSchema({"title": "Prompt", "anyOf": [  # what is accepted
        {"type": "string", "minLength": 1},
        {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1},
        {"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1, "maxItems": 1}]})]
    max_tokens: Annotated[int, Field(ge=1)] | None = 16  # OpenAI's default for completions

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, v: str | list[int] | list[str]) -> str | list[int]:
        if isinstance(v, list) and v and isinstance(v[0], str):
            if len(v) != 1:
                raise ValueError("one prompt per request (batching happens in the server)")
            v = v[0]
        if not v:
            raise ValueError("the prompt is empty")
        return cast("str | list[int]", v)  # a list of strings was replaced by its one string above


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None

    def as_template_message(self) -> dict:
        text = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)
        return {"role": "system" if self.role == "developer" else self.role, "content": text}


class ChatCompletionRequest(_Sampling):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: Annotated[int, Field(ge=1)] | None = None  # None: up to the context
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None  # the newer name of max_tokens

    @model_validator(mode="after")
    def _one_limit(self):
        if None not in (self.max_tokens, self.max_completion_tokens) and self.max_tokens != self.max_completion_tokens:
            raise ValueError("max_tokens and max_completion_tokens differ; send one of them")
        return self


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """OpenAI's error body."""

    error: ErrorDetail


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}
