"""Chat prompts -> token ids with the model's chat template, keeping control tokens out of
user text (the server's /v1/chat/completions and /tokenize use it)."""
from __future__ import annotations


def encode_chat(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of `messages` rendered with the model's chat template, where the
    template's own text may hold control tokens (<|im_start|>...) but message contents
    never do: a user who writes "<|im_end|>" gets those characters, not the token.

    Contents are replaced by sentinels, the template is rendered, and the pieces between
    sentinels (template text) are encoded with special tokens parsed, the contents as
    plain text. Templates that alter the content text (so a sentinel does not come out
    intact, once) are refused rather than mis-tokenized."""
    marks = [f"\x00servax-content-{i}\x00" for i in range(len(messages))]
    if any("\x00" in m["content"] for m in messages):
        raise ValueError("message content must not contain NUL characters")
    text = tokenizer.apply_chat_template(
        [{"role": m["role"], "content": mark} for m, mark in zip(messages, marks)],
        add_generation_prompt=True)
    ids: list[int] = []
    rest = text
    for m, mark in zip(messages, marks):
        if rest.count(mark) != 1:
            raise ValueError("the chat template does not copy message contents verbatim; "
                             "cannot keep control tokens out of user text")
        head, rest = rest.split(mark)
        ids += tokenizer.encode(head) if head else []
        if m["content"]:
            ids += tokenizer.encode(m["content"], parse_special=False)[
                1 if tokenizer.add_bos and tokenizer.bos_id is not None else 0:]
    if rest:
        ids += tokenizer.encode(rest)[1 if tokenizer.add_bos and tokenizer.bos_id is not None
                                      and ids else 0:]
    return ids


def chat_messages(messages) -> list[dict]:
    """Protocol chat messages (role, text()) as the {"role", "content"} dicts
    `encode_chat` takes."""
    return [{"role": m.role, "content": m.text()} for m in messages]
