"""The Qwen tokenizer (tokenizer.json through the tokenizers package) and the chat template."""
from __future__ import annotations

import logging
from .model import ModelLoadError

log = logging.getLogger("comfy_metal")

# ------------------------------------------------------------------------------------------ tokenizer

class Tokenizer:
    """tokenizer.json (via `tokenizers`) + the chat template from tokenizer_config.json if present."""

    def __init__(self, tokenizer_json: str, tokenizer_config: dict | None = None, where: str = "tokenizer.json"):
        from tokenizers import Tokenizer as HFTokenizer

        try:
            self.tok = HFTokenizer.from_str(tokenizer_json)
        except Exception as e:
            raise ModelLoadError(f"{where}: not a valid tokenizer.json ({e})") from None
        self.config = tokenizer_config or {}
        self.chat_template = self.config.get("chat_template")

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids, skip_special_tokens=True) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_id(self, token: str):
        return self.tok.token_to_id(token)

    def eos_ids(self) -> list[int]:
        out = []
        eos = self.config.get("eos_token")
        if isinstance(eos, dict):
            eos = eos.get("content")
        for t in ([eos] if eos else []) + ["<|im_end|>", "<|endoftext|>"]:
            i = self.token_id(t)
            if i is not None and i not in out:
                out.append(i)
        return out

    def apply_chat_template(self, user: str, system: str | None = None) -> str:
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user}]
        if self.chat_template:
            try:
                import jinja2

                env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
                env.globals["raise_exception"] = lambda msg: (_ for _ in ()).throw(ValueError(msg))
                return env.from_string(self.chat_template).render(
                    messages=messages, add_generation_prompt=True, enable_thinking=False,
                    bos_token="", eos_token="")
            except Exception as e:  # a template we cannot render: fall back to the plain Qwen one
                log.warning("comfy_metal: chat template failed to render (%s); using the plain Qwen template", e)
        text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
        return text + "<|im_start|>assistant\n"
