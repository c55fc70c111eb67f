"""Chat templates: the built-in Qwen2.5 ones and a sandboxed jinja renderer.

Rendering follows what Hugging Face `apply_chat_template` does, so a
checkpoint's own template renders here byte for byte as it does there:
`ImmutableSandboxedEnvironment` with `trim_blocks` and `lstrip_blocks`, loop
controls (`break`/`continue`), a `tojson` that does not HTML-escape,
`raise_exception` and `strftime_now`, and `{% generation %}` blocks accepted
(rendered as plain text; we never need the assistant mask). Templates come
from untrusted checkpoint files, hence the sandbox.

Qwen3 (no built-in copy: a Qwen3 run reads the checkpoint's own template,
`tokenizer.kind="auto"`). Prompts are rendered with the generation prompt and
without `enable_thinking`, as `apply_chat_template` does by default: thinking
mode, the prompt ends at `<|im_start|>assistant\n` and the model opens its own
`<think>` block (`enable_thinking=False` would append an empty one to the
prompt instead). The thinking is KEPT in the response: it is the policy's
output, trained on and counted in the length budget and the overlong buffer.
`<think>` / `</think>` are added tokens NOT flagged special in Qwen3's
tokenizer.json, so decoding with `skip_special_tokens=True`
(trainer/generation.py) leaves them in the text, and the verifiers read the
answer after the last `</think>` (rewards/math_dapo.answer_region).
"""

import datetime
import functools
import json
from typing import Any, Mapping, Sequence

import jinja2
import jinja2.ext
import jinja2.sandbox

# Qwen2.5 (base and instruct) ship this template in tokenizer_config.json;
# reproduced verbatim because the rendered prompt must match the checkpoint's.
QWEN25_CHAT_TEMPLATE = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}
    {%- else %}
        {{- '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\n<tool_call>\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- message.content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"""

QWEN25_SYSTEM_PROMPT = (
    "You are Qwen, created by Alibaba Cloud. You are a helpful assistant.")
QWEN25_MATH_SYSTEM_PROMPT = (
    "Please reason step by step, and put your final answer within \\boxed{}.")

# Qwen2.5-Math ships the same template with only the default system prompt
# changed. Inside the template it is a jinja string literal, so the backslash
# of \boxed is doubled.
QWEN25_MATH_CHAT_TEMPLATE = QWEN25_CHAT_TEMPLATE.replace(
    QWEN25_SYSTEM_PROMPT, QWEN25_MATH_SYSTEM_PROMPT.replace("\\", "\\\\"))

# CharTokenizer's template: ChatML without a default system turn, because the
# arithmetic prompts stay short and the 64-id alphabet lacks most capitals.
CHAR_CHAT_TEMPLATE = r"""{%- for message in messages %}
    {{- '<|im_start|>' + message['role'] + '\n' }}
    {{- message['content'] + '<|im_end|>\n' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"""

CHAT_TEMPLATES = {
    "qwen2.5": QWEN25_CHAT_TEMPLATE,
    "qwen2.5-math": QWEN25_MATH_CHAT_TEMPLATE,
    "char": CHAR_CHAT_TEMPLATE,
}


class _GenerationBlock(jinja2.ext.Extension):
  """Parses HF's `{% generation %}...{% endgeneration %}` as a no-op block."""

  tags = {"generation"}

  def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
    lineno = next(parser.stream).lineno
    body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
    return jinja2.nodes.Scope(body).set_lineno(lineno)


def _raise_exception(message: str) -> None:
  raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None,
            sort_keys: bool = False) -> str:
  # Jinja's own tojson HTML-escapes '<', '>', '&' and "'", which would change
  # tool schemas in the prompt; HF templates expect plain json.dumps.
  return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent,
                    separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
  return datetime.datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=32)
def compile_chat_template(source: str) -> jinja2.Template:
  """Compiles a chat template in a sandbox with HF's environment settings."""
  env = jinja2.sandbox.ImmutableSandboxedEnvironment(
      trim_blocks=True, lstrip_blocks=True,
      extensions=[jinja2.ext.loopcontrols, _GenerationBlock])
  env.filters["tojson"] = _tojson
  env.globals["raise_exception"] = _raise_exception
  env.globals["strftime_now"] = _strftime_now
  return env.from_string(source)


def render_chat_template(source: str,
                         messages: Sequence[Mapping[str, Any]],
                         *,
                         add_generation_prompt: bool = True,
                         tools: Sequence[Mapping[str, Any]] | None = None,
                         special_tokens: Mapping[str, str | None] | None = None,
                         **template_kwargs: Any) -> str:
  """Renders `messages` with the template `source`.

  Args:
    source: jinja template text.
    messages: `{"role", "content", ...}` dicts.
    add_generation_prompt: end with the assistant turn header.
    tools: optional tool schemas, as HF passes them.
    special_tokens: `bos_token`, `eos_token`, ... strings the template may use.
    **template_kwargs: extra template variables (e.g. `enable_thinking`).

  Returns:
    The rendered prompt text.
  """
  for i, message in enumerate(messages):
    if not isinstance(message, Mapping):
      raise TypeError(f"chat message {i} must be a dict with 'role' and "
                      f"'content', got {type(message).__name__}: {message!r}")
  variables = dict(special_tokens or {})
  variables.update(template_kwargs)
  variables.update(
      # Fresh dicts, so a template never touches the caller's messages. Keys
      # set to None are dropped as transformers 5 does: templates test for a
      # missing key (`is defined`), and would print "None" otherwise.
      messages=[{k: v for k, v in m.items() if v is not None}
                for m in messages],
      tools=[dict(t) for t in tools] if tools is not None else None,
      documents=None,
      add_generation_prompt=add_generation_prompt)
  return compile_chat_template(source).render(**variables)
