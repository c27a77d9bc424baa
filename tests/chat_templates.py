"""Chat templates written for the tests that behave like the official Qwen3, Qwen3.5 and Qwen3.6 ones.

Written here from a reading of the official templates (tokenizer_config.json / chat_template.jinja of
Qwen3-8B, Qwen3.5-2B/-27B and Qwen3.6-27B); none of their text is copied, only these behaviours:

Qwen3
  * reasoning comes from ``reasoning_content`` when it is a string, else from ``content`` split at ``</think>``;
  * assistant turns after the last real user query (a user message that is not a wrapped tool response)
    render ``<think>\\n{reasoning stripped of newlines}\\n</think>\\n\\n{content}``, but only the final message
    or one with reasoning; every other assistant turn renders its content alone (reasoning dropped);
  * a tool call is ``<tool_call>\\n{"name": NAME, "arguments": ARGS}\\n</tool_call>``: ARGS verbatim when a
    string, else ``tojson``; a newline before each call unless it is the first and the content is empty;
  * consecutive tool messages share one user turn of ``\\n<tool_response>\\n...\\n</tool_response>`` blocks;
  * the generation prompt is ``<|im_start|>assistant\\n``, plus ``<think>\\n\\n</think>\\n\\n`` when
    ``enable_thinking`` is false.
Qwen3.5 (27B: thinking on by default; the small ones, e.g. 2B: thinking off by default)
  * every message's content is trimmed; reasoning is trimmed;
  * assistant turns after the last user query always render ``<think>\\n{reasoning}\\n</think>\\n\\n{content}``
    (an empty reasoning gives ``<think>\\n\\n</think>\\n\\n``); earlier ones their content alone;
  * tool calls in XML: ``<tool_call>\\n<function=NAME>\\n`` (preceded by ``\\n\\n`` when the first call follows
    content, by ``\\n`` for later calls), one ``<parameter=KEY>\\nVALUE\\n</parameter>\\n`` per argument from
    ``arguments|items`` (a string ``arguments`` therefore fails to render), ``</function>\\n</tool_call>``;
  * the generation prompt ends in ``<think>\\n`` with thinking on, ``<think>\\n\\n</think>\\n\\n`` with it off.
Qwen3.6: as Qwen3.5 27B, and ``preserve_thinking=true`` renders every assistant turn with its reasoning.
"""

from __future__ import annotations

_LAST_QUERY = r"""
{%- set ns = namespace(last_query=-1) -%}
{%- for m in messages -%}
    {%- if m.role == 'user' -%}
        {%- set text = m.content if m.content is string else '' -%}
        {%- if not (text.startswith('<tool_response>') and text.endswith('</tool_response>')) -%}
            {%- set ns.last_query = loop.index0 -%}
        {%- endif -%}
    {%- endif -%}
{%- endfor -%}
"""

_TOOL_MESSAGE = r"""
    {%- elif m.role == 'tool' -%}
        {%- if loop.first or messages[loop.index0 - 1].role != 'tool' -%}
            {{- '<|im_start|>user' -}}
        {%- endif -%}
        {{- '\n<tool_response>\n' + TEXT + '\n</tool_response>' -}}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' -%}
            {{- '<|im_end|>\n' -}}
        {%- endif -%}
"""

QWEN3_LIKE = (
    r"""{#- test template: Qwen3 behaviours (see tests/chat_templates.py) -#}
{%- if tools -%}
    {{- '<|im_start|>system\n' -}}
    {%- if messages[0].role == 'system' -%}
        {{- messages[0].content + '\n\n' -}}
    {%- endif -%}
    {{- '# Functions\n<tools>' -}}
    {%- for t in tools -%}
        {{- '\n' + t | tojson -}}
    {%- endfor -%}
    {{- '\n</tools>\nAnswer a call as <tool_call>\n{"name": ..., "arguments": ...}\n</tool_call><|im_end|>\n' -}}
{%- elif messages[0].role == 'system' -%}
    {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' -}}
{%- endif -%}
"""
    + _LAST_QUERY
    + r"""
{%- for m in messages -%}
    {%- if m.role == 'system' -%}
        {%- if not loop.first -%}
            {{- '<|im_start|>system\n' + m.content + '<|im_end|>\n' -}}
        {%- endif -%}
    {%- elif m.role == 'user' -%}
        {{- '<|im_start|>user\n' + m.content + '<|im_end|>\n' -}}
    {%- elif m.role == 'assistant' -%}
        {%- set content = m.content if m.content is string else '' -%}
        {%- set reasoning = '' -%}
        {%- if m.reasoning_content is string -%}
            {%- set reasoning = m.reasoning_content -%}
        {%- elif '</think>' in content -%}
            {%- set reasoning = content.split('</think>')[0].split('<think>')[-1] -%}
            {%- set content = content.split('</think>')[-1].lstrip('\n') -%}
        {%- endif -%}
        {{- '<|im_start|>assistant\n' -}}
        {%- if loop.index0 > ns.last_query and (loop.last or reasoning) -%}
            {{- '<think>\n' + reasoning.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') -}}
        {%- else -%}
            {{- content -}}
        {%- endif -%}
        {%- for call in (m.tool_calls or []) -%}
            {%- set fn = call.function if call.function is defined else call -%}
            {%- if content or not loop.first -%}
                {{- '\n' -}}
            {%- endif -%}
            {{- '<tool_call>\n{"name": "' + fn.name + '", "arguments": ' -}}
            {%- if fn.arguments is string -%}
                {{- fn.arguments -}}
            {%- else -%}
                {{- fn.arguments | tojson -}}
            {%- endif -%}
            {{- '}\n</tool_call>' -}}
        {%- endfor -%}
        {{- '<|im_end|>\n' -}}
"""
    + _TOOL_MESSAGE.replace("TEXT", "m.content")
    + r"""
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- '<|im_start|>assistant\n' -}}
    {%- if enable_thinking is defined and enable_thinking is false -%}
        {{- '<think>\n\n</think>\n\n' -}}
    {%- endif -%}
{%- endif -%}"""
)


def _qwen35_like(thinking_default: bool, preserve: bool) -> str:
    on = "not (enable_thinking is defined and enable_thinking is false)" if thinking_default else (
        "enable_thinking is defined and enable_thinking is true")
    keep = "(preserve_thinking is defined and preserve_thinking is true) or " if preserve else ""
    return (
        r"""{#- test template: Qwen3.5/3.6 behaviours (see tests/chat_templates.py) -#}
{%- if tools -%}
    {{- '<|im_start|>system\n# Functions\n<tools>' -}}
    {%- for t in tools -%}
        {{- '\n' + t | tojson -}}
    {%- endfor -%}
    {{- '\n</tools>\nCall one as <tool_call>\n<function=NAME>\n<parameter=KEY>\nVALUE\n</parameter>\n</function>\n</tool_call>' -}}
    {%- if messages[0].role == 'system' and messages[0].content | trim -%}
        {{- '\n\n' + messages[0].content | trim -}}
    {%- endif -%}
    {{- '<|im_end|>\n' -}}
{%- elif messages[0].role == 'system' -%}
    {{- '<|im_start|>system\n' + messages[0].content | trim + '<|im_end|>\n' -}}
{%- endif -%}
"""
        + _LAST_QUERY
        + r"""
{%- for m in messages -%}
    {%- set text = (m.content if m.content is string else '') | trim -%}
    {%- if m.role == 'system' -%}
        {%- if not loop.first -%}
            {{- raise_exception('a system message must come first') -}}
        {%- endif -%}
    {%- elif m.role == 'user' -%}
        {{- '<|im_start|>user\n' + text + '<|im_end|>\n' -}}
    {%- elif m.role == 'assistant' -%}
        {%- set content = text -%}
        {%- set reasoning = '' -%}
        {%- if m.reasoning_content is string -%}
            {%- set reasoning = m.reasoning_content -%}
        {%- elif '</think>' in content -%}
            {%- set reasoning = content.split('</think>')[0].split('<think>')[-1] -%}
            {%- set content = content.split('</think>')[-1].lstrip('\n') -%}
        {%- endif -%}
        {%- set reasoning = reasoning | trim -%}
        {{- '<|im_start|>assistant\n' -}}
        {%- if KEEP loop.index0 > ns.last_query -%}
            {{- '<think>\n' + reasoning + '\n</think>\n\n' -}}
        {%- endif -%}
        {{- content -}}
        {%- for call in (m.tool_calls or []) -%}
            {%- set fn = call.function if call.function is defined else call -%}
            {%- if not loop.first -%}
                {{- '\n' -}}
            {%- elif content -%}
                {{- '\n\n' -}}
            {%- endif -%}
            {{- '<tool_call>\n<function=' + fn.name + '>\n' -}}
            {%- for key, value in fn.arguments | items -%}
                {{- '<parameter=' + key + '>\n' -}}
                {%- if value is mapping or (value is sequence and value is not string) -%}
                    {{- value | tojson -}}
                {%- else -%}
                    {{- value | string -}}
                {%- endif -%}
                {{- '\n</parameter>\n' -}}
            {%- endfor -%}
            {{- '</function>\n</tool_call>' -}}
        {%- endfor -%}
        {{- '<|im_end|>\n' -}}
""".replace("KEEP", keep)
        + _TOOL_MESSAGE.replace("TEXT", "text")
        + r"""
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- '<|im_start|>assistant\n' -}}
    {%- if ON -%}
        {{- '<think>\n' -}}
    {%- else -%}
        {{- '<think>\n\n</think>\n\n' -}}
    {%- endif -%}
{%- endif -%}""".replace("ON", on)
    )


QWEN35_LIKE = _qwen35_like(thinking_default=True, preserve=False)  # Qwen3.5-27B
QWEN35_SMALL_LIKE = _qwen35_like(thinking_default=False, preserve=False)  # Qwen3.5-2B and smaller
QWEN36_LIKE = _qwen35_like(thinking_default=True, preserve=True)  # Qwen3.6-27B
