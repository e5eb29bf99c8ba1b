"""Text in and out: the artifact's tokenizer.json (the tokenizers library) and chat template
(jinja2, rendered as Hugging Face's apply_chat_template does: sandboxed, trim_blocks,
lstrip_blocks, add_generation_prompt), and streamed detokenization."""

from __future__ import annotations

from datetime import datetime

from .errors import RuntimeRefusal


class NoTokenizer(RuntimeRefusal):
    """The artifact carries no tokenizer.json (or no chat template where one is needed)."""


class Text:
    def __init__(self, art, eos_ids: list[int] | None = None, bos_id: int | None = None):
        from tokenizers import Tokenizer
        if not art.tokenizer_json:
            raise NoTokenizer(f"{art.path}: the artifact holds no tokenizer (its checkpoint had no tokenizer.json); "
                              f"pass token ids instead (bloomery logits --ids)")
        try:
            self.tok = Tokenizer.from_str(art.tokenizer_json)
        except Exception as e:              # the tokenizers library raises a bare Exception
            raise NoTokenizer(f"{art.path}: its tokenizer (tokenizer.huggingface.json) does not load ({e}); fix the "
                              f"checkpoint's tokenizer.json and prepare again, or pass token ids (bloomery logits "
                              f"--ids)") from None
        self.template = art.chat_template
        self.eos_ids = list(eos_ids or [])
        self.bos_id = bos_id
        self.where = str(art.path)

    def token(self, i: int | None) -> str:
        return (self.tok.id_to_token(int(i)) or "") if i is not None else ""

    def render(self, prompt: str) -> str:
        """The chat template applied to one user message, with the assistant's turn opened."""
        return self.render_messages([{"role": "user", "content": prompt}])

    def render_messages(self, messages: list[dict]) -> str:
        """The chat template applied to a conversation ([{"role", "content"}, ...]), with the
        assistant's turn opened."""
        if not self.template:
            raise NoTokenizer(f"{self.where}: the artifact holds no chat template; use --raw")
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(msg):
            raise NoTokenizer(f"{self.where}: chat template: {msg}")

        from jinja2 import TemplateError

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        try:
            return env.from_string(self.template).render(
                messages=messages, add_generation_prompt=True,
                bos_token=self.token(self.bos_id), eos_token=self.token(self.eos_ids[0] if self.eos_ids else None))
        except TemplateError as e:
            raise NoTokenizer(f"{self.where}: the chat template does not render ({type(e).__name__}: {e}); fix the "
                              f"checkpoint's template and prepare again, or use --raw") from None

    def encode(self, prompt: str, raw: bool = False) -> list[int]:
        if raw:
            return self.ids(prompt, special=True)
        return self.encode_messages([{"role": "user", "content": prompt}])

    def ids(self, text: str, special: bool = False) -> list[int]:
        """The tokenizer's ids of text as it is (its special tokens added where `special`)."""
        return self.tok.encode(text, add_special_tokens=special).ids

    def encode_messages(self, messages: list[dict]) -> list[int]:
        return self.tok.encode(self.render_messages(messages), add_special_tokens=False).ids

    def decode(self, ids: list[int], special: bool = False) -> str:
        """The text of ids (special tokens left out unless `special`)."""
        return self.tok.decode(list(ids), skip_special_tokens=not special)

    def stream(self) -> "Stream":
        return Stream(self)


class Stream:
    """Feeds ids one at a time, returns the new text each time: the whole decode minus what was
    already given out, held back while it ends in an incomplete UTF-8 sequence (U+FFFD);
    flush() gives what is left at the end."""

    def __init__(self, text: Text):
        self.text, self.ids, self.sent = text, [], 0

    def push(self, i: int) -> str:
        self.ids.append(int(i))
        s = self.text.decode(self.ids)
        if s.endswith("\ufffd"):
            return ""
        new, self.sent = s[self.sent:], len(s)
        return new

    def flush(self) -> str:
        """What is still held back, at the end."""
        s = self.text.decode(self.ids)
        new, self.sent = s[self.sent:], len(s)
        return new
