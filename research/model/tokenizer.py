"""Byte-level BPE tokenizer rebuilt from GGUF metadata with the `tokenizers` library.

The pre-tokenizer follows llama.cpp's `tokenizer.ggml.pre` name (SmolLM2: "smollm" =
every digit split off, then GPT-2's regex); control tokens (type 3) and user-defined
tokens (type 4) are atomic special tokens. The chat template is the GGUF's own Jinja
template rendered in a sandbox with the helpers Hugging Face's `apply_chat_template`
provides (see `chat_template_env`).
"""
from __future__ import annotations

import datetime
import functools
import json
from typing import Any, Sequence

import jinja2.ext
import jinja2.nodes
import jinja2.sandbox
import tokenizers
from tokenizers import decoders, models, pre_tokenizers

GPT2_REGEX = (r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+")
LLAMA3_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?"
                r"[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
TOKEN_TYPE_CONTROL, TOKEN_TYPE_USER_DEFINED = 3, 4


def _byte_level(use_regex: bool):
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=use_regex)


def _split(regex: str):
    return pre_tokenizers.Split(tokenizers.Regex(regex), behavior="isolated")


PRE_TOKENIZERS = {
    "smollm": lambda: pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), _byte_level(True)]),
    "gpt2": lambda: _byte_level(True),
    "default": lambda: _byte_level(True),
    "llama-bpe": lambda: pre_tokenizers.Sequence([_split(LLAMA3_REGEX), _byte_level(False)]),
}



def check_unicode(text: str, name: str) -> None:
    """ValueError naming `name` when `text` holds lone surrogates: what Python makes of
    non-UTF-8 bytes (command-line arguments, files read with errors="surrogateescape")."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        ch = text[e.start]
        origin = (f"byte {ord(ch) - 0xDC00:#04x} of non-UTF-8 input"
                  if 0xDC80 <= ord(ch) <= 0xDCFF else "a lone surrogate")
        raise ValueError(f"{name} is not valid UTF-8 text: character {e.start} is {origin} "
                         f"({ch!r}); expected UTF-8") from None


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`: HF marks assistant text for training
    masks with it; rendering emits the body unchanged."""
    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller):
        return caller()


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    """HF's `tojson`: json.dumps as is (Jinja's own escapes <, >, & and ' for HTML and
    takes only `indent`)."""
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(format):
    return datetime.datetime.now().strftime(format)


def chat_template_env() -> jinja2.sandbox.ImmutableSandboxedEnvironment:
    """The Jinja environment Hugging Face renders chat templates in (transformers'
    `_compile_jinja_template`): sandboxed, trim_blocks and lstrip_blocks, loop controls
    ({% break %}, {% continue %}), `{% generation %}` blocks, the globals
    `raise_exception(message)` and `strftime_now(format)` and the filter
    `tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False)`."""
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True,
        extensions=[jinja2.ext.loopcontrols, _GenerationTag])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


@functools.lru_cache(maxsize=16)
def _compile(template: str) -> jinja2.Template:
    try:
        return chat_template_env().from_string(template)
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise ValueError(f"the chat template does not parse: {e} (line {e.lineno})") from e


class Tokenizer:
    def __init__(self, tokens: Sequence[str], merges: Sequence[str],
                 token_types: Sequence[int], *, pre: str, bos_id: int | None,
                 eos_id: int | None, add_bos: bool = False, chat_template: str | None = None):
        if pre not in PRE_TOKENIZERS:
            raise ValueError(f"tokenizer.ggml.pre={pre!r} is not supported; "
                             f"supported: {sorted(PRE_TOKENIZERS)}")
        vocab = {tok: i for i, tok in enumerate(tokens)}
        pairs = [tuple(m.split(" ", 1)) for m in merges]
        tok = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False))
        tok.pre_tokenizer = PRE_TOKENIZERS[pre]()
        tok.decoder = decoders.ByteLevel()
        special = [tokenizers.AddedToken(tokens[i], special=True, normalized=False)
                   for i, t in enumerate(token_types)
                   if t in (TOKEN_TYPE_CONTROL, TOKEN_TYPE_USER_DEFINED)]
        tok.add_special_tokens(special)
        self._tok = tok
        self.vocab_size = len(tokens)
        self.bos_id, self.eos_id, self.add_bos = bos_id, eos_id, add_bos
        self.special_ids = frozenset(tok.token_to_id(t.content) for t in special)
        self.chat_template = chat_template

    def encode(self, text: str, *, parse_special: bool = True) -> list[int]:
        """Token ids of `text` (plus BOS when the model asks for it).

        parse_special=False treats text like "<|im_end|>" as plain characters (use it for
        untrusted user text).
        """
        if not isinstance(text, str):
            raise TypeError(f"text must be str, got {type(text).__name__}")
        check_unicode(text, "text")
        self._tok.encode_special_tokens = not parse_special
        ids = self._tok.encode(text, add_special_tokens=False).ids
        return ([self.bos_id] if self.add_bos and self.bos_id is not None else []) + ids

    def decode(self, ids: Sequence[int], *, skip_special: bool = False) -> str:
        ids = [int(i) for i in ids]
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise ValueError(f"token ids {bad[:5]} out of range [0, {self.vocab_size})")
        return self._tok.decode(ids, skip_special_tokens=skip_special)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def apply_chat_template(self, messages: Sequence[dict], *,
                            add_generation_prompt: bool = True,
                            tools: Sequence[dict] | None = None, **template_vars: Any) -> str:
        """Render chat `messages` ([{"role", "content"}]) with the model's own template.

        Variables as Hugging Face passes them: messages, add_generation_prompt, tools,
        bos_token, eos_token, plus `template_vars`. A template's raise_exception (say,
        "roles must alternate") and a template that does not parse are ValueErrors.
        """
        if not self.chat_template:
            raise ValueError("this GGUF carries no tokenizer.chat_template")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or {"role", "content"} - set(m):
                raise ValueError(f"messages[{i}] must be a dict with 'role' and 'content'")
        template = _compile(self.chat_template)
        try:
            return template.render(messages=list(messages),
                                   add_generation_prompt=add_generation_prompt,
                                   tools=None if tools is None else list(tools),
                                   bos_token=self._token_str(self.bos_id),
                                   eos_token=self._token_str(self.eos_id), **template_vars)
        except jinja2.exceptions.TemplateError as e:
            raise ValueError(f"chat template: {e}") from e

    def _token_str(self, token_id: int | None) -> str:
        return "" if token_id is None else self._tok.id_to_token(token_id)
