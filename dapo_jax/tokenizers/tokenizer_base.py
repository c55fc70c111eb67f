"""`Tokenizer`: what the rest of dapo_jax needs from a tokenizer.

Import it from `dapo_jax.tokenizers`; it lives here so the tokenizers in
`tokenizer.py` and `char_tokenizer.py` can share it without an import cycle.
"""

import abc
from typing import Any, Iterable, Mapping, Sequence

from dapo_jax.tokenizers import chat_templates


class Tokenizer(abc.ABC):
  """Text <-> ids, and prompt rendering with the model's chat template.

  Attributes:
    eos_id: the checkpoint's end-of-sequence id.
    eos_ids: every id that ends a generation (eos_id first): the checkpoint's own and the
      chat-end markers the vocabulary has.
    checkpoint_eos_ids: the checkpoint's own stop ids only (eos_id and generation_config's
      eos_token_id), what vLLM and so verl stop on.
    pad_id: id used to pad batches.
    chat_template: jinja source, or {name: source} when a checkpoint ships
      several (HF picks "tool_use" when tools are given, else "default").
  """

  eos_id: int
  eos_ids: tuple[int, ...]
  pad_id: int

  @property
  def checkpoint_eos_ids(self) -> tuple[int, ...]:
    return (self.eos_id,)

  chat_template: str | dict[str, str] | None = None
  # bos_token/eos_token/... strings, visible to chat templates as in HF.
  _special_tokens_map: dict[str, str] = {}

  @property
  @abc.abstractmethod
  def vocab_size(self) -> int:
    """Number of ids the tokenizer can produce (max id + 1).

    A model's embedding may have more rows (Qwen2.5 pads 151,665 to 151,936
    or 152,064); ids past vocab_size decode to nothing.
    """

  @abc.abstractmethod
  def encode(self, text: str) -> list[int]:
    """Ids of `text`; special tokens written in it map to their ids."""

  @abc.abstractmethod
  def decode(self, ids: Iterable[int], skip_special_tokens: bool = False
             ) -> str:
    """Text of `ids`; invalid UTF-8 from a cut-off sequence becomes U+FFFD."""

  @abc.abstractmethod
  def token_to_id(self, token: str) -> int | None:
    """Id of one vocabulary entry (special or regular), None if absent."""

  def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
    return [self.encode(t) for t in texts]

  def decode_batch(self, batch: Sequence[Iterable[int]],
                   skip_special_tokens: bool = False) -> list[str]:
    return [self.decode(ids, skip_special_tokens) for ids in batch]

  @property
  def special_tokens_map(self) -> dict[str, str]:
    return dict(self._special_tokens_map)

  def get_chat_template(self, tools: Sequence[Any] | None = None) -> str:
    """The template apply_chat_template uses, chosen as HF chooses it."""
    template = self.chat_template
    if isinstance(template, Mapping):
      name = "tool_use" if tools is not None and "tool_use" in template else (
          "default")
      if name not in template:
        raise ValueError(f"{self!r} has chat templates {sorted(template)} but "
                         "no 'default' one")
      template = template[name]
    if not template:
      raise ValueError(
          f"{self!r} has no chat template: add chat_template to the "
          "checkpoint's tokenizer_config.json (or a chat_template.jinja file)")
    return template

  def apply_chat_template(self,
                          messages: Sequence[Mapping[str, Any]],
                          add_generation_prompt: bool = True,
                          tokenize: bool = False,
                          *,
                          tools: Sequence[Mapping[str, Any]] | None = None,
                          **template_kwargs: Any) -> str | list[int]:
    """Renders a conversation as the model was trained to see it.

    Args:
      messages: `{"role": ..., "content": ...}` dicts.
      add_generation_prompt: end with the assistant header, ready to sample.
      tokenize: return ids instead of text.
      tools: tool schemas, for templates that support them.
      **template_kwargs: extra template variables.

    Returns:
      The prompt text, or its ids when tokenize=True.
    """
    text = chat_templates.render_chat_template(
        self.get_chat_template(tools), messages,
        add_generation_prompt=add_generation_prompt, tools=tools,
        special_tokens=self._special_tokens_map, **template_kwargs)
    return self.encode(text) if tokenize else text

  def __repr__(self) -> str:
    where = getattr(self, "path", None)
    return f"{type(self).__name__}({str(where) if where else ''})"
