"""The server's protocol: pydantic models of the OpenAI (and vLLM tokenizer) schema, the
OpenAI error body, and the JSON body reader with its limits.

Requests are strict (`extra="forbid"`, no type coercion: "8" is not an integer), so an
unknown or mistyped field is a 400 whose `param` names it (`messages[0].role`), never a
silently ignored field. Fields OpenAI defines that this server does not implement are
declared and refused with a 400 unless they hold their no-op value.

Body limits: at most `max_body_bytes` (ServerConfig, 8 MiB by default; 413 above it) and
JSON nested at most MAX_JSON_DEPTH deep (400 above it; a 20,000-deep array used to be a
500 from the parser's recursion); a JSON content type (`application/json` or
`application/*+json`, 415 otherwise); no NaN / Infinity literals (not JSON).

Every number is bounded where it is parsed: an integer that becomes an int32 array on the
engine (top_k, max_tokens, token ids) is at most INT32_MAX here, and the router checks
what depends on the model (token ids and top_k against the vocabulary, max_tokens against
the context). A top_k of 2**31 used to overflow the engine's int32 array on the engine
thread and stop the engine.
"""
from __future__ import annotations

import json
import re
from typing import Any, Literal, Union

from pydantic import (BaseModel, ConfigDict, Field, ValidationError, ValidationInfo,
                      field_validator)
from pydantic_core import PydanticCustomError

from research.decode.sampling import OPENAI_MAX_TEMPERATURE, SAMPLING_FIELDS, sampling_bound
from research.serving.api import MAX_LOGPROBS

MAX_JSON_DEPTH = 64
MAX_BODY_BYTES = 8 << 20
MAX_STOP_STRINGS = 16  # OpenAI takes 4; lm-eval tasks send more (their `until` + EOS)
MAX_N = 16  # choices per prompt
MAX_LOGIT_BIAS = 300  # entries, as OpenAI
INT32_MAX = 2**31 - 1  # the largest value of the engine's int32 arrays (top_k, token ids)
_TOKEN_KEY = re.compile(r"[0-9]{1,10}")  # a logit_bias key: ASCII digits ("²", "٥" are not)


class ApiError(Exception):
    """An HTTP error with an OpenAI-style body; `param` names the offending field."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 type_: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.type = status, message, param, type_
        self.code = code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


# --------------------------------------------------------------------------- the body


_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"')
_BRACKETS = re.compile(rb"[\[\]{}]+")


def json_depth_ok(raw: bytes, limit: int = MAX_JSON_DEPTH) -> bool:
    """Whether the brackets of JSON text `raw` (outside strings) nest at most `limit`
    deep; a cheap pre-check (regex scans, in C) before the recursive parser sees it."""
    if raw.count(b"[") + raw.count(b"{") <= limit:
        return True
    depth = 0
    for run in _BRACKETS.findall(_STRING.sub(b"", raw)):
        for ch in run:
            depth += 1 if ch in (0x5B, 0x7B) else -1
            if depth > limit:
                return False
    return True


def json_content_type_ok(value: str | None) -> bool:
    """Whether a Content-Type header names JSON: application/json or application/*+json,
    any parameters (charset) allowed."""
    mime = (value or "").split(";", 1)[0].strip().lower()
    kind, _, sub = mime.partition("/")
    return kind == "application" and (sub == "json" or (sub.endswith("+json") and len(sub) > 5))


def check_json_content_type(value: str | None) -> None:
    """ApiError(415) unless `value` (a Content-Type header) names JSON."""
    if not json_content_type_ok(value):
        raise ApiError(415, f"Content-Type must be application/json, got {value!r}"[:200],
                       None, "invalid_request_error", "unsupported_media_type")


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON value")


def parse_json_object(raw: bytes) -> dict:
    """The request body as a JSON object, or ApiError(400, param="body")."""
    if not json_depth_ok(raw):
        raise ApiError(400, f"request body is nested deeper than {MAX_JSON_DEPTH} levels",
                       "body")
    try:
        body = json.loads(raw, parse_constant=_no_constant)
    except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError is a ValueError
        raise ApiError(400, f"request body is not valid JSON: {e}", "body") from None
    except RecursionError:
        raise ApiError(400, "request body is nested too deeply", "body") from None
    if not isinstance(body, dict):
        raise ApiError(400, f"request body must be a JSON object, got {type(body).__name__}",
                       "body")
    return body


# --------------------------------------------------------------------------- errors


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "literal"}
_DICT_FIELDS = {"logit_bias"}  # their keys are data (token ids), not field names


def loc_to_param(loc: tuple) -> str | None:
    """pydantic's error location -> the field's name as a client wrote it:
    ("messages", 0, "role") -> "messages[0].role"; union member tags are dropped."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
            continue
        part = str(part)
        if (part.lower() in _TYPE_TAGS or not part.replace("_", "").isalnum()
                or part.startswith("function-")):
            break  # a type tag of a union member, not a field
        out += f".{part}" if out else part
        if out in _DICT_FIELDS:
            break
    return out or None


_UNION_HINTS = {
    "prompt": "prompt must be a non-empty string, a list of strings, a list of token ids "
              "or a list of token-id lists",
    "stop": "stop must be a string or a list of strings",
    "content": "must be a string or a list of {'type': 'text', 'text': str} parts",
}


def validation_error(e: ValidationError) -> ApiError:
    """The first error of a pydantic validation as a 400 naming the field."""
    errors = e.errors(include_url=False)
    extra = [err for err in errors if err["type"] == "extra_forbidden"]
    if extra:
        names = [loc_to_param(err["loc"]) or "?" for err in extra]
        return ApiError(400, f"unrecognized request argument(s): {', '.join(names)}",
                        names[0])
    err = errors[0]
    param = loc_to_param(err["loc"])
    last = (param or "").rsplit(".", 1)[-1]
    if last in _UNION_HINTS and len([x for x in errors if loc_to_param(x["loc"]) == param]) > 1:
        msg = _UNION_HINTS[last] if last != "content" else f"{param} {_UNION_HINTS[last]}"
    else:
        value = err.get("input")
        shown = "" if isinstance(value, (dict, list)) else f", got {value!r}"[:200]
        msg = f"{param}: {err['msg']}{shown}"
    return ApiError(400, msg, param)


def unsupported(name: str, value: Any, why: str = "") -> ApiError:
    return ApiError(400, f"{name}={value!r} is not supported by this server{why}"[:300], name)


# --------------------------------------------------------------------------- requests


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False


# accepted only at their no-op value (None, empty): anything else is a 400 naming them
NOOP_FIELDS = ("tools", "tool_choice", "response_format", "parallel_tool_calls",
               "functions", "function_call", "suffix")


class _Sampling(_Strict):
    """Fields completions and chat share (OpenAI + vLLM's extensions top_k,
    repetition_penalty, stop_token_ids)."""

    model: str = Field(min_length=1)
    # temperature / top_p / top_k: research/decode/sampling.py's bounds (`_sampling`),
    # temperature at most OpenAI's 2; top_k -1 or 0: off (vLLM uses -1), the router
    # bounds it by the vocabulary
    temperature: float | None = None
    top_k: int | None = Field(None, le=INT32_MAX)
    top_p: float | None = None
    seed: int | None = Field(None, ge=-2**63, lt=2**63)
    stop: Union[str, list[str], None] = None
    stop_token_ids: list[int] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # an end-user id; logged nowhere, kept for compatibility
    n: int = Field(1, ge=1, le=MAX_N)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(1.0, gt=0.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    tools: Any = None
    tool_choice: Any = None
    response_format: Any = None
    parallel_tool_calls: Any = None
    functions: Any = None
    function_call: Any = None

    @field_validator(*SAMPLING_FIELDS)
    @classmethod
    def _sampling(cls, value, info: ValidationInfo):
        """The sampling settings' one validation (research/decode/sampling.py)."""
        if value is None:
            return value
        bound = sampling_bound(info.field_name, 0 if value == -1 and info.field_name == "top_k"
                               else value, max_temperature=OPENAI_MAX_TEMPERATURE)
        if bound is not None:
            raise PydanticCustomError("sampling_bounds", bound + (
                " or -1" if info.field_name == "top_k" else ""))
        return value

    def refuse_noops(self) -> None:
        for name in NOOP_FIELDS:
            value = getattr(self, name, None)
            if value not in (None, "", [], {}, False):
                raise unsupported(name, value)

    def stop_list(self) -> tuple[str, ...]:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if not all(stop):
            raise ApiError(400, "stop strings must be non-empty", "stop")
        if len(stop) > MAX_STOP_STRINGS:
            raise ApiError(400, f"stop takes at most {MAX_STOP_STRINGS} strings, got "
                                f"{len(stop)}", "stop")
        return tuple(stop)

    def bias_pairs(self, vocab_size: int) -> tuple[tuple[int, float], ...]:
        bias = self.logit_bias or {}
        if len(bias) > MAX_LOGIT_BIAS:
            raise ApiError(400, f"logit_bias takes at most {MAX_LOGIT_BIAS} entries",
                           "logit_bias")
        pairs = []
        for key, value in bias.items():
            if not (_TOKEN_KEY.fullmatch(key) and int(key) < vocab_size):
                raise ApiError(400, f"logit_bias keys must be token ids in [0, {vocab_size})"
                                    f" written in ASCII digits, got {key[:40]!r}", "logit_bias")
            if not -100.0 <= value <= 100.0:
                raise ApiError(400, f"logit_bias values must be in [-100, 100], got "
                                    f"{value!r}", "logit_bias")
            pairs.append((int(key), float(value)))
        return tuple(sorted(pairs))


class CompletionRequest(_Sampling):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    max_tokens: int | None = Field(None, ge=0, le=INT32_MAX)  # 0: echo + logprobs only
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    best_of: int | None = Field(None, ge=1, le=MAX_N)
    suffix: str | None = None


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "user", "assistant"]
    content: Union[str, list[TextPart]]
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1, le=INT32_MAX)
    max_completion_tokens: int | None = Field(None, ge=1, le=INT32_MAX)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)


class TokenizeCompletionRequest(_Strict):
    """vLLM's POST /tokenize, text form."""

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(_Strict):
    """vLLM's POST /tokenize, chat form (rendered as /v1/chat/completions does)."""

    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    add_special_tokens: bool = False
    return_token_strs: bool = False


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[int]


# --------------------------------------------------------------------------- responses


class _Out(BaseModel):
    model_config = ConfigDict(extra="forbid")


class PromptTokensDetails(_Out):
    cached_tokens: int = 0


class Usage(_Out):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails = PromptTokensDetails()


class CompletionLogprobs(_Out):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(_Out):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None


class CompletionResponse(_Out):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class TopLogprob(_Out):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(_Out):
    content: list[TokenLogprob]


class AssistantMessage(_Out):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(_Out):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None


class ChatCompletionResponse(_Out):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class TokenizeResponse(_Out):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(_Out):
    prompt: str


class TokenizerInfo(_Out):
    tokenizer_class: str
    bos_token: str | None
    eos_token: str | None
    pad_token: str | None
    unk_token: str | None
    chat_template: str | None
    model_max_length: int
    add_bos_token: bool
    vocab_size: int


class ModelCard(_Out):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "servax"
    root: str
    parent: str | None = None
    max_model_len: int


class ModelList(_Out):
    object: Literal["list"] = "list"
    data: list[ModelCard]
