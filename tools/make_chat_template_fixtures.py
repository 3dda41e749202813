#!/usr/bin/env python3
"""Writes tests/fixtures/chat_templates/<family>/{tokenizer_config.json, cases.json}: chat templates of
real model families rendered by transformers' apply_chat_template(tokenize=False), the reference that
coordinator/chat must reproduce byte for byte (tests/chat_template_test.cc).

Environment (PyPI, pinned; no Hugging Face hub access is needed, the templates are written here):
  python3 -m venv .venv-chat && .venv-chat/bin/pip install transformers==4.49.0 jinja2==3.1.6 tokenizers==0.21.4
  .venv-chat/bin/python tools/make_chat_template_fixtures.py

The template strings are data. Copied from llama.cpp's models/templates corpus: DeepSeek-R1 distill,
Hermes 3 tool_use, Mistral Small 3.1, Command R7B tool_use. Qwen3 from a public copy of its template.
Gemma 3 as google/gemma-3-*-it's tokenizer_config.json has it (the same text in several public copies:
the gemma-3-1b-it and gemma-3-12b-it GGUF metadata, transformers' Gemma 3 processor test). Phi-4 (14B) and
Phi-4-mini-instruct from several agreeing public quotations of their tokenizer_config.json; Phi-4's is the
revision with add_generation_prompt (its first release appended the assistant header to each user turn).
ChatML, Llama 2, Llama 3, Llama 3.1, Qwen2.5, Mistral 7B v0.1, Gemma 2, Phi-3.5 and Hermes 3's default
were written out from the models' published templates without a byte-for-byte check against the hub
(no hub access here); whatever their exact bytes, transformers renders the very strings stored in the
fixtures, so the engine is compared with transformers on them. Each case: messages, add_generation_prompt, tools (or null),
extra keyword arguments, and either "expected" (the rendered text) or "error" (the message the template
raised).
"""
import json
import os
import sys

import jinja2
import transformers
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from transformers import PreTrainedTokenizerFast

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "tests", "fixtures", "chat_templates")

CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")

LLAMA2 = ("{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}{% set system_message = messages[0]['content'] %}"
          "{% else %}{% set loop_messages = messages %}{% set system_message = false %}{% endif %}{% for message in loop_messages %}"
          "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
          "{% if loop.index0 == 0 and system_message != false %}{% set content = '<<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n' + message['content'] %}"
          "{% else %}{% set content = message['content'] %}{% endif %}{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}"
          "{% elif message['role'] == 'assistant' %}{{ ' '  + content.strip() + ' ' + eos_token }}{% endif %}{% endfor %}")

LLAMA3 = ("{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' %}"
          "{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")

LLAMA31 = r'''{{- bos_token }}
{%- if custom_tools is defined %}
    {%- set tools = custom_tools %}
{%- endif %}
{%- if not tools_in_user_message is defined %}
    {%- set tools_in_user_message = true %}
{%- endif %}
{%- if not date_string is defined %}
    {%- set date_string = "26 Jul 2024" %}
{%- endif %}
{%- if not tools is defined %}
    {%- set tools = none %}
{%- endif %}

{#- This block extracts the system message, so we can slot it into the right place. #}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}

{#- System message + builtin tools #}
{{- "<|start_header_id|>system<|end_header_id|>\n\n" }}
{%- if builtin_tools is defined or tools is not none %}
    {{- "Environment: ipython\n" }}
{%- endif %}
{%- if builtin_tools is defined %}
    {{- "Tools: " + builtin_tools | reject('equalto', 'code_interpreter') | join(", ") + "\n\n"}}
{%- endif %}
{{- "Cutting Knowledge Date: December 2023\n" }}
{{- "Today Date: " + date_string + "\n\n" }}
{%- if tools is not none and not tools_in_user_message %}
    {{- "You have access to the following functions. To call a function, please respond with JSON for a function call." }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\n\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\n\n" }}
    {%- endfor %}
{%- endif %}
{{- system_message }}
{{- "<|eot_id|>" }}

{#- Custom tools are passed in a user message with some extra guidance #}
{%- if tools_in_user_message and not tools is none %}
    {#- Extract the first user message so we can plug it in here #}
    {%- if messages | length != 0 %}
        {%- set first_user_message = messages[0]['content']|trim %}
        {%- set messages = messages[1:] %}
    {%- else %}
        {{- raise_exception("Cannot put tools in the first user message when there's no first user message!") }}
{%- endif %}
    {{- '<|start_header_id|>user<|end_header_id|>\n\n' -}}
    {{- "Given the following functions, please respond with a JSON for a function call " }}
    {{- "with its proper arguments that best answers the given prompt.\n\n" }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\n\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\n\n" }}
    {%- endfor %}
    {{- first_user_message + "<|eot_id|>"}}
{%- endif %}

{%- for message in messages %}
    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' }}
    {%- elif 'tool_calls' in message %}
        {%- if not message.tool_calls|length == 1 %}
            {{- raise_exception("This model only supports single tool-calls at once!") }}
        {%- endif %}
        {%- set tool_call = message.tool_calls[0].function %}
        {%- if builtin_tools is defined and tool_call.name in builtin_tools %}
            {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}
            {{- "<|python_tag|>" + tool_call.name + ".call(" }}
            {%- for arg_name, arg_val in tool_call.arguments | items %}
                {{- arg_name + '="' + arg_val + '"' }}
                {%- if not loop.last %}
                    {{- ", " }}
                {%- endif %}
                {%- endfor %}
            {{- ")" }}
        {%- else  %}
            {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}
            {{- '{"name": "' + tool_call.name + '", ' }}
            {{- '"parameters": ' }}
            {{- tool_call.arguments | tojson }}
            {{- "}" }}
        {%- endif %}
        {%- if builtin_tools is defined %}
            {#- This means we're in ipython mode #}
            {{- "<|eom_id|>" }}
        {%- else %}
            {{- "<|eot_id|>" }}
        {%- endif %}
    {%- elif message.role == "tool" or message.role == "ipython" %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\n\n" }}
        {%- if message.content is mapping or message.content is iterable %}
            {{- message.content | tojson }}
        {%- else %}
            {{- message.content }}
        {%- endif %}
        {{- "<|eot_id|>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- endif %}
'''

QWEN25 = r'''{%- if tools %}
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
'''

MISTRAL = ("{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
           "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
           "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}{% elif message['role'] == 'assistant' %}"
           "{{ message['content'] + eos_token}}{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}{% endfor %}")

GEMMA2 = ("{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
          "{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
          "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
          "{% if (message['role'] == 'assistant') %}{% set role = 'model' %}{% else %}{% set role = message['role'] %}{% endif %}"
          "{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{'<start_of_turn>model\n'}}{% endif %}")

PHI35 = ("{% for message in messages %}{% if message['role'] == 'system' and message['content'] %}{{'<|system|>\n' + message['content'] + '<|end|>\n'}}"
         "{% elif message['role'] == 'user' %}{{'<|user|>\n' + message['content'] + '<|end|>\n'}}{% elif message['role'] == 'assistant' %}"
         "{{'<|assistant|>\n' + message['content'] + '<|end|>\n'}}{% endif %}{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% else %}{{ eos_token }}{% endif %}")

DEEPSEEK_R1 = "{% if not add_generation_prompt is defined -%}\n  {%- set add_generation_prompt = false -%}\n{%- endif -%}\n{%- set ns = namespace(is_first=false, is_tool=false, is_output_first=true, system_prompt='') -%}\n{%- for message in messages -%}\n  {%- if message['role'] == 'system' -%}\n    {%- set ns.system_prompt = message['content'] -%}\n  {%- endif -%}\n{%- endfor -%}{{bos_token}}{{ns.system_prompt}}\n{%- for message in messages -%}\n  {%- if message['role'] == 'user' -%}\n    {%- set ns.is_tool = false -%}{{'<｜User｜>' + message['content']}}\n  {%- endif -%}\n  {%- if message['role'] == 'assistant' and message['tool_calls'] -%}\n    {%- set ns.is_tool = false -%}\n    {%- for tool in message['tool_calls']-%}\n      {%- if not ns.is_first -%}\n        {{'<｜Assistant｜><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' + tool['type'] + '<｜tool▁sep｜>' + tool['function']['name'] + '\\n' + '```json' + '\\n' + tool['function']['arguments'] + '\\n' + '```' + '<｜tool▁call▁end｜>'}}\n        {%- set ns.is_first = true -%}\n      {%- else -%}\n        {{'\\n' + '<｜tool▁call▁begin｜>' + tool['type'] + '<｜tool▁sep｜>' + tool['function']['name'] + '\\n' + '```json' + '\\n' + tool['function']['arguments'] + '\\n' + '```' + '<｜tool▁call▁end｜>'}}\n      {%- endif -%}\n    {%- endfor -%}\n    {{'<｜tool▁calls▁end｜><｜end▁of▁sentence｜>'}}\n  {%- endif -%}\n  {%- if message['role'] == 'assistant' and message['content'] is not none -%}\n    {%- if ns.is_tool -%}{{'<｜tool▁outputs▁end｜>' + message['content'] + '<｜end▁of▁sentence｜>'}}\n      {%- set ns.is_tool = false -%}\n    {%- else -%}\n      {%- set content = message['content'] -%}\n      {%- if '</think>' in content -%}\n        {%- set content = content.split('</think>')[-1] -%}\n      {%- endif -%}{{'<｜Assistant｜>' + content + '<｜end▁of▁sentence｜>'}}\n    {%- endif -%}\n  {%- endif -%}\n  {%- if message['role'] == 'tool' -%}\n    {%- set ns.is_tool = true -%}\n    {%- if ns.is_output_first -%}{{'<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>' + message['content'] + '<｜tool▁output▁end｜>'}}\n      {%- set ns.is_output_first = false -%}\n      {%- else -%}{{'\\n<｜tool▁output▁begin｜>' + message['content'] + '<｜tool▁output▁end｜>'}}\n    {%- endif -%}\n  {%- endif -%}\n{%- endfor -%}\n{%- if ns.is_tool -%}{{'<｜tool▁outputs▁end｜>'}}\n{%- endif -%}\n{%- if add_generation_prompt and not ns.is_tool -%}{{'<｜Assistant｜><think>\\n'}}\n{%- endif %}"

HERMES_TOOL_USE = "{%- macro json_to_python_type(json_spec) %}\n{%- set basic_type_map = {\n    \"string\": \"str\",\n    \"number\": \"float\",\n    \"integer\": \"int\",\n    \"boolean\": \"bool\"\n} %}\n\n{%- if basic_type_map[json_spec.type] is defined %}\n    {{- basic_type_map[json_spec.type] }}\n{%- elif json_spec.type == \"array\" %}\n    {{- \"list[\" +  json_to_python_type(json_spec|items) + \"]\"}}\n{%- elif json_spec.type == \"object\" %}\n    {%- if json_spec.additionalProperties is defined %}\n        {{- \"dict[str, \" + json_to_python_type(json_spec.additionalProperties) + ']'}}\n    {%- else %}\n        {{- \"dict\" }}\n    {%- endif %}\n{%- elif json_spec.type is iterable %}\n    {{- \"Union[\" }}\n    {%- for t in json_spec.type %}\n      {{- json_to_python_type({\"type\": t}) }}\n      {%- if not loop.last %}\n        {{- \",\" }} \n    {%- endif %}\n    {%- endfor %}\n    {{- \"]\" }}\n{%- else %}\n    {{- \"Any\" }}\n{%- endif %}\n{%- endmacro %}\n\n\n{{- bos_token }}\n{{- '<|im_start|>system\n' }}\n{{- \"You are a function calling AI model. You are provided with function signatures within <tools></tools> XML tags. You may call one or more functions to assist with the user query. Don't make assumptions about what values to plug into functions. Here are the available tools: <tools> \" }}\n{%- for tool in tools %}\n    {%- if tool.function is defined %}\n        {%- set tool = tool.function %}\n    {%- endif %}\n    {{- '{\"type\": \"function\", \"function\": ' }}\n    {{- '{\"name\": \"' + tool.name + '\", ' }}\n    {{- '\"description\": \"' + tool.name + '(' }}\n    {%- for param_name, param_fields in tool.parameters.properties|items %}\n        {{- param_name + \": \" + json_to_python_type(param_fields) }}\n        {%- if not loop.last %}\n            {{- \", \" }}\n        {%- endif %}\n    {%- endfor %}\n    {{- \")\" }}\n    {%- if tool.return is defined %}\n        {{- \" -> \" + json_to_python_type(tool.return) }}\n    {%- endif %}\n    {{- \" - \" + tool.description + \"\n\n\" }}\n    {%- for param_name, param_fields in tool.parameters.properties|items %}\n        {%- if loop.first %}\n            {{- \"    Args:\n\" }}\n        {%- endif %}\n        {{- \"        \" + param_name + \"(\" + json_to_python_type(param_fields) + \"): \" + param_fields.description|trim }}\n    {%- endfor %}\n    {%- if tool.return is defined and tool.return.description is defined %}\n        {{- \"\n    Returns:\n        \" + tool.return.description }}\n    {%- endif %}\n    {{- '\"' }}\n    {{- ', \"parameters\": ' }}\n    {%- if tool.parameters.properties | length == 0 %}\n        {{- \"{}\" }}\n    {%- else %}\n        {{- tool.parameters|tojson }}\n    {%- endif %}\n    {{- \"}}\" }}\n    {%- if not loop.last %}\n        {{- \"\n\" }}\n    {%- endif %}\n{%- endfor %}\n{{- \" </tools>\" }}\n{{- 'Use the following pydantic model json schema for each tool call you will make: {\"properties\": {\"name\": {\"title\": \"Name\", \"type\": \"string\"}, \"arguments\": {\"title\": \"Arguments\", \"type\": \"object\"}}, \"required\": [\"name\", \"arguments\"], \"title\": \"FunctionCall\", \"type\": \"object\"}}\n' }}\n{{- \"For each function call return a json object with function name and arguments within <tool_call></tool_call> XML tags as follows:\n\" }}\n{{- \"<tool_call>\n\" }}\n{{- '{\"name\": <function-name>, \"arguments\": <args-dict>}\n' }}\n{{- '</tool_call><|im_end|>\n' }}\n{%- for message in messages %}\n    {%- if message.role == \"user\" or message.role == \"system\" or (message.role == \"assistant\" and message.tool_calls is not defined) %}\n        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}\n    {%- elif message.role == \"assistant\" %}\n        {{- '<|im_start|>' + message.role }}\n    {%- for tool_call in message.tool_calls %}\n       {{- '\n<tool_call>\n' }}           {%- if tool_call.function is defined %}\n                {%- set tool_call = tool_call.function %}\n            {%- endif %}\n            {{- '{' }}\n            {{- '\"name\": \"' }}\n            {{- tool_call.name }}\n            {{- '\"' }}\n            {{- ', '}}\n            {%- if tool_call.arguments is defined %}\n                {{- '\"arguments\": ' }}\n                {%- if tool_call.arguments is string %}\n                    {{- tool_call.arguments }}\n                {%- else %}\n                    {{- tool_call.arguments|tojson }}\n                {%- endif %}\n            {%- endif %}\n             {{- '}' }}\n            {{- '\n</tool_call>' }}\n    {%- endfor %}\n        {{- '<|im_end|>\n' }}\n    {%- elif message.role == \"tool\" %}\n        {%- if loop.previtem and loop.previtem.role != \"tool\" %}\n            {{- '<|im_start|>tool\n' }}\n        {%- endif %}\n        {{- '<tool_response>\n' }}\n        {{- message.content }}\n        {%- if not loop.last %}\n            {{- '\n</tool_response>\n' }}\n        {%- else %}\n            {{- '\n</tool_response>' }}\n        {%- endif %}\n        {%- if not loop.last and loop.nextitem.role != \"tool\" %}\n            {{- '<|im_end|>' }}\n        {%- elif loop.last %}\n            {{- '<|im_end|>' }}\n        {%- endif %}\n    {%- endif %}\n{%- endfor %}\n{%- if add_generation_prompt %}\n    {{- '<|im_start|>assistant\n' }}\n{%- endif %}\n"

# Hermes 3 publishes a list of named templates; "default" is ChatML with a BOS.
HERMES_DEFAULT = ("{{bos_token}}{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
                  "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")

# Mistral Small 3.1 (llama.cpp corpus): strftime_now() picks the default system prompt's date, so every
# conversation here carries its own system message and the output does not depend on the day.
MISTRAL_SMALL_3_1 = "{%- set today = strftime_now(\"%Y-%m-%d\") %}\n{%- set default_system_message = \"You are Mistral Small 3, a Large Language Model (LLM) created by Mistral AI, a French startup headquartered in Paris.\\\nYour knowledge base was last updated on 2023-10-01. The current date is \" + today + \".\\\n\\\nWhen you're not sure about some information, you say that you don't have the information and don't make up anything.\\\nIf the user's question is not clear, ambiguous, or does not provide enough context for you to accurately answer the question, you do not try to answer it right away and you rather ask the user to clarify their request (e.g. \\\"What are some good restaurants around me?\\\" => \\\"Where are you?\\\" or \\\"When is the next flight to Tokyo\\\" => \\\"Where do you travel from?\\\")\" %}\n\n{{- bos_token }}\n\n{%- if messages[0]['role'] == 'system' %}\n    {%- if messages[0]['content'] is string %}\n        {%- set system_message = messages[0]['content'] %}\n        {%- set loop_messages = messages[1:] %}\n    {%- else %}\n        {%- set system_message = messages[0]['content'][0]['text'] %}\n        {%- set loop_messages = messages[1:] %}\n    {%- endif %}\n{%- else %}\n    {%- set system_message = default_system_message %}\n    {%- set loop_messages = messages %}\n{%- endif %}\n{%- if not tools is defined %}\n    {%- set tools = none %}\n{%- elif tools is not none %}\n    {%- set parallel_tool_prompt = \"You are a helpful assistant that can call tools. If you call one or more tools, format them in a single JSON array or objects, where each object is a tool call, not as separate objects outside of an array or multiple arrays. Use the format [{\\\"name\\\": tool call name, \\\"arguments\\\": tool call arguments}, additional tool calls] if you call more than one tool. If you call tools, do not attempt to interpret them or otherwise provide a response until you receive a tool call result that you can interpret for the user.\" %}\n    {%- if system_message is defined %}\n        {%- set system_message = parallel_tool_prompt + \"\\\n\\\n\" + system_message %}\n    {%- else %}\n        {%- set system_message = parallel_tool_prompt %}\n    {%- endif %}\n{%- endif %}\n{{- '[SYSTEM_PROMPT]' + system_message + '[/SYSTEM_PROMPT]' }}\n\n{%- set user_messages = loop_messages | selectattr(\"role\", \"equalto\", \"user\") | list %}\n\n{%- set filtered_messages = [] %}\n{%- for message in loop_messages %}\n    {%- if message[\"role\"] not in [\"tool\", \"tool_results\"] and not message.get(\"tool_calls\") %}\n        {%- set filtered_messages = filtered_messages + [message] %}\n    {%- endif %}\n{%- endfor %}\n\n{%- for message in filtered_messages %}\n    {%- if (message[\"role\"] == \"user\") != (loop.index0 % 2 == 0) %}\n        {{- raise_exception(\"After the optional system message, conversation roles must alternate user/assistant/user/assistant/...\") }}\n    {%- endif %}\n{%- endfor %}\n\n{%- for message in loop_messages %}\n    {%- if message[\"role\"] == \"user\" %}\n        {%- if tools is not none and (message == user_messages[-1]) %}\n            {{- \"[AVAILABLE_TOOLS] [\" }}\n            {%- for tool in tools %}\n                {%- set tool = tool.function %}\n                {{- '{\"type\": \"function\", \"function\": {' }}\n                {%- for key, val in tool.items() if key != \"return\" %}\n                    {%- if val is string %}\n                        {{- '\"' + key + '\": \"' + val + '\"' }}\n                    {%- else %}\n                        {{- '\"' + key + '\": ' + val|tojson }}\n                    {%- endif %}\n                    {%- if not loop.last %}\n                        {{- \", \" }}\n                    {%- endif %}\n                {%- endfor %}\n                {{- \"}}\" }}\n                {%- if not loop.last %}\n                    {{- \", \" }}\n                {%- else %}\n                    {{- \"]\" }}\n                {%- endif %}\n            {%- endfor %}\n            {{- \"[/AVAILABLE_TOOLS]\" }}\n        {%- endif %}\n        {%- if message['content'] is string %}\n        {{- '[INST]' + message['content'] + '[/INST]' }}\n        {%- else %}\n                {{- '[INST]' }}\n                {%- for block in message['content'] %}\n                        {%- if block['type'] == 'text' %}\n                                {{- block['text'] }}\n                        {%- elif block['type'] == 'image' or block['type'] == 'image_url' %}\n                                {{- '[IMG]' }}\n                            {%- else %}\n                                {{- raise_exception('Only text and image blocks are supported in message content!') }}\n                            {%- endif %}\n                    {%- endfor %}\n                {{- '[/INST]' }}\n            {%- endif %}\n    {%- elif message[\"role\"] == \"tool_calls\" or message.tool_calls is defined %}\n        {%- if message.tool_calls is defined %}\n            {%- set tool_calls = message.tool_calls %}\n        {%- else %}\n            {%- set tool_calls = message.content %}\n        {%- endif %}\n        {{- \"[TOOL_CALLS] [\" }}\n        {%- for tool_call in tool_calls %}\n            {%- set out = tool_call.function|tojson %}\n            {{- out[:-1] }}\n            {%- if not tool_call.id is defined or tool_call.id|length < 9 %}\n                {{- raise_exception(\"Tool call IDs should be alphanumeric strings with length >= 9! (1)\" + tool_call.id) }}\n            {%- endif %}\n            {{- ', \"id\": \"' + tool_call.id[-9:] + '\"}' }}\n            {%- if not loop.last %}\n                {{- \", \" }}\n            {%- else %}\n                {{- \"]\" + eos_token }}\n            {%- endif %}\n        {%- endfor %}\n    {%- elif message['role'] == 'assistant' %}\n        {%- if message['content'] is string %}\n            {{- message['content'] + eos_token }}\n        {%- else %}\n            {{- message['content'][0]['text'] + eos_token }}\n        {%- endif %}\n    {%- elif message[\"role\"] == \"tool_results\" or message[\"role\"] == \"tool\" %}\n        {%- if message.content is defined and message.content.content is defined %}\n            {%- set content = message.content.content %}\n        {%- else %}\n            {%- set content = message.content %}\n        {%- endif %}\n        {{- '[TOOL_RESULTS] {\"content\": ' + content|string + \", \" }}\n        {%- if not message.tool_call_id is defined or message.tool_call_id|length < 9 %}\n            {{- raise_exception(\"Tool call IDs should be alphanumeric strings with length >= 9! (2)\" + message.tool_call_id) }}\n        {%- endif %}\n        {{- '\"call_id\": \"' + message.tool_call_id[-9:] + '\"}[/TOOL_RESULTS]' }}\n    {%- else %}\n        {{- raise_exception(\"Only user and assistant roles are supported, with the exception of an initial optional system message!\") }}\n    {%- endif %}\n{%- endfor %}\n"

# Command R7B's tool_use template (llama.cpp corpus): macros, namespaces holding lists, break.
COMMAND_R7B_TOOL_USE = "{{ bos_token }}{%- macro document_turn(documents) -%}\n{# format documents into chat turn #}\n<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|><|START_THINKING|>I will look through the document to address the users needs.<|END_THINKING|><|START_ACTION|>[\n    {\"tool_call_id\": \"0\", \"tool_name\": \"direct-injected-document\", \"parameters\": {}}\n]<|END_ACTION|><|END_OF_TURN_TOKEN|><|START_OF_TURN_TOKEN|><|SYSTEM_TOKEN|><|START_TOOL_RESULT|>[\n    {\n        \"tool_call_id\": \"0\",\n        \"results\": {\n{% for doc in documents %}\n            \"{{ loop.index0 }}\": {{doc|tojson}}{% if not loop.last %},\n            {% endif %}\n{% endfor %}\n\n        },\n        \"is_error\": null\n    }\n]<|END_TOOL_RESULT|><|END_OF_TURN_TOKEN|>{%- endmacro %}\n{%- macro tool_call_id_to_int(messages, tool_call_id) %}\n{%- set counter = namespace(value=0) %}\n{%- set tool_call_id_seen = namespace(value=false) %}\n{%- for msg in messages %}\n    {%- if msg.tool_calls %}\n        {%- for tool_call in msg.tool_calls %}\n            {%- if tool_call.id == tool_call_id and not tool_call_id_seen.value -%}\n                {{ counter.value }}\n                {%- set tool_call_id_seen.value = true %}\n            {%- endif %}\n            {%- set counter.value = counter.value + 1 %}\n        {%- endfor %}\n    {%- endif %}\n{%- endfor %}\n{%- endmacro %}\n{%- macro format_tool_message(messages, tool_msg) -%}\n{# format tool message #}\n    {\n        \"tool_call_id\": \"{{ tool_call_id_to_int(messages, tool_msg.tool_call_id) }}\",\n        \"results\": {\n            \"0\": {{ tool_msg.content|tojson }}\n        },\n        \"is_error\": null\n    }\n{%- endmacro -%}\n{%- if messages and messages[0]['role']|lower == 'system' %}{%- set developer_preamble = messages[0]['content'] %}{% endif %}\n{%- set tool_idx = namespace(value=0) %}\n{%- set tool_ids_seen = namespace(value=[]) %}\n{%- set sent_documents = namespace(value=false) %}\n<|START_OF_TURN_TOKEN|><|SYSTEM_TOKEN|># System Preamble\nYou are in contextual safety mode. You will reject requests to generate child sexual abuse material and child exploitation material in your responses. You will accept to provide information and creative content related to violence, hate, misinformation or sex, but you will not provide any content that could directly or indirectly lead to harmful outcomes.\n\nYour information cutoff date is June 2024.\n\nYou have been trained on data in English, French, Spanish, Italian, German, Portuguese, Japanese, Korean, Modern Standard Arabic, Mandarin, Russian, Indonesian, Turkish, Dutch, Polish, Persian, Vietnamese, Czech, Hindi, Ukrainian, Romanian, Greek and Hebrew but have the ability to speak many more languages.\n{% if tools or documents %}\n\nYou have been trained to have advanced reasoning and tool-use capabilities and you should make best use of these skills to serve user's requests.\n\n## Tool Use\nThink about how you can make best use of the provided tools to help with the task and come up with a high level plan that you will execute first.\n\n0. Start by writing <|START_THINKING|> followed by a detailed step by step plan of how you will solve the problem. For each step explain your thinking fully and give details of required tool calls (if needed). Unless specified otherwise, you write your plan in natural language. When you finish, close it out with <|END_THINKING|>.\n    You can optionally choose to skip this step when the user request is so straightforward to address that only a trivial plan would be needed.\n    NOTE: You MUST skip this step when you are directly responding to the user's request without using any tools.\n\nThen carry out your plan by repeatedly executing the following steps.\n1. Action: write <|START_ACTION|> followed by a list of JSON-formatted tool calls, with each one containing \"tool_name\" and \"parameters\" fields.\n    When there are multiple tool calls which are completely independent of each other (i.e. they can be executed in parallel), you should list them out all together in one step. When you finish, close it out with <|END_ACTION|>.\n2. Observation: you will then receive results of those tool calls in JSON format in the very next turn, wrapped around by <|START_TOOL_RESULT|> and <|END_TOOL_RESULT|>. Carefully observe those results and think about what to do next. Note that these results will be provided to you in a separate turn. NEVER hallucinate results.\n    Every tool call produces a list of results (when a tool call produces no result or a single result, it'll still get wrapped inside a list). Each result is clearly linked to its originating tool call via its \"tool_call_id\".\n3. Reflection: start the next turn by writing <|START_THINKING|> followed by what you've figured out so far, any changes you need to make to your plan, and what you will do next. When you finish, close it out with <|END_THINKING|>.\n    You can optionally choose to skip this step when everything is going according to plan and no special pieces of information or reasoning chains need to be recorded.\n    NOTE: You MUST skip this step when you are done with tool-use actions and are ready to respond to the user.\n\nYou can repeat the above 3 steps multiple times (could be 0 times too if no suitable tool calls are available or needed), until you decide it's time to finally respond to the user.\n\n4. Response: then break out of the loop and write <|START_RESPONSE|> followed by a piece of text which serves as a response to the user's last request. Use all previous tool calls and results to help you when formulating your response. When you finish, close it out with <|END_RESPONSE|>.\n{% if enable_citations %}\n\n## Grounding\nImportantly, note that \"Reflection\" and \"Response\" above can be grounded.\nGrounding means you associate pieces of texts (called \"spans\") with those specific tool results that support them (called \"sources\"). And you use a pair of tags \"<co>\" and \"</co>\" to indicate when a span can be grounded onto a list of sources, listing them out in the closing tag. Sources from the same tool call are grouped together and listed as \"{tool_call_id}:[{list of result indices}]\", before they are joined together by \",\". E.g., \"<co>span</co: 0:[1,2],1:[0]>\" means that \"span\" is supported by result 1 and 2 from \"tool_call_id=0\" as well as result 0 from \"tool_call_id=1\".\n{% endif %}\n\n## Available Tools\nHere is the list of tools that you have available to you.\nYou can ONLY use the tools listed here. When a tool is not listed below, it is NOT available and you should NEVER attempt to use it.\nEach tool is represented as a JSON object with fields like \"name\", \"description\", \"parameters\" (per JSON Schema), and optionally, \"responses\" (per JSON Schema).\n\n```json\n[\n{% if documents %}\n    {\"name\": \"direct-injected-document\", \"description\": \"This is a special tool to directly inject user-uploaded documents into the chat as additional context. DO NOT use this tool by yourself!\", \"parameters\": {\"type\": \"object\", \"properties\": {}, \"required\": []}, \"responses\": {\"200\": {\"description\": \"Successfully returned a list of chunked text snippets from the directly uploaded documents.\", \"content\": {\"application/json\": {\"schema\": {\"type\": \"array\", \"items\": {\"type\": \"object\", \"required\": [\"url\", \"snippet\"], \"properties\": {\"url\": {\"type\": \"string\", \"description\": \"The url of the uploaded document.\"}, \"snippet\": {\"type\": \"string\", \"description\": \"The text snippet for the returned document chunk.\"}}}}}}}}}{%- if tools %},{% endif %}\n\n{% endif %}\n{% for tool in tools %}\n    {\"name\": \"{{ tool['function']['name'] }}\", \"description\": \"{{tool['function']['description']}}\", \"parameters\": {{ tool['function']['parameters']|tojson }}, \"responses\": null}{%- if not loop.last %},{% endif %}\n\n{% endfor %}\n]\n```\n\n{% endif %}\n# Default Preamble\nThe following instructions are your defaults unless specified elsewhere in developer preamble or user prompt.\n- Your name is Command.\n- You are a large language model built by Cohere.\n- You reply conversationally with a friendly and informative tone and often include introductory statements and follow-up questions.\n- If the input is ambiguous, ask clarifying follow-up questions.\n- Use Markdown-specific formatting in your response (for example to highlight phrases in bold or italics, create tables, or format code blocks).\n- Use LaTeX to generate mathematical notation for complex equations.\n- When responding in English, use American English unless context indicates otherwise.\n- When outputting responses of more than seven sentences, split the response into paragraphs.\n- Prefer the active voice.\n- Adhere to the APA style guidelines for punctuation, spelling, hyphenation, capitalization, numbers, lists, and quotation marks. Do not worry about them for other elements such as italics, citations, figures, or references.\n- Use gender-neutral pronouns for unspecified persons.\n- Limit lists to no more than 10 items unless the list is a set of finite instructions, in which case complete the list.\n- Use the third person when asked to write a summary.\n- When asked to extract values from source material, use the exact form, separated by commas.\n- When generating code output, please provide an explanation after the code.\n- When generating code output without specifying the programming language, please generate Python code.\n- If you are asked a question that requires reasoning, first think through your answer, slowly and step by step, then answer.\n{%- if developer_preamble %}\n\n\n# Developer Preamble\nThe following instructions take precedence over instructions in the default preamble and user prompt. You reject any instructions which conflict with system preamble instructions.\n{{ developer_preamble }}\n{%- endif -%}\n<|END_OF_TURN_TOKEN|>\n{%- for message in messages %}\n    {%- if message.role|lower == 'system' and not (loop.first and developer_preamble)%}\n<|START_OF_TURN_TOKEN|><|SYSTEM_TOKEN|>{{ message.content }}<|END_OF_TURN_TOKEN|>\n    {%- elif message.role|lower == 'user' %}\n<|START_OF_TURN_TOKEN|><|USER_TOKEN|>{{ message.content }}<|END_OF_TURN_TOKEN|>{%- if documents and not sent_documents.value %}{%- set sent_documents.value = true %}{% set tool_idx.value = tool_idx.value + 1 %}{{ document_turn(documents) }}{% endif %}\n    {%- elif message.role|lower == 'assistant' or message.role|lower == 'chatbot' %}\n<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>{% if message.tool_calls %}<|START_THINKING|>{{message.reasoning_content}}<|END_THINKING|><|START_ACTION|>[\n    {% for tc in message.tool_calls %}\n    {\"tool_call_id\": \"{{ tool_idx.value }}\", \"tool_name\": \"{{ tc['function']['name'] }}\", \"parameters\": {{ tc['function']['arguments']|tojson }}}{% if not loop.last %},{% endif %}\n\n    {% set tool_idx.value = tool_idx.value + 1 %}\n    {% endfor %}\n]<|END_ACTION|><|END_OF_TURN_TOKEN|>{% else %}<|START_RESPONSE|>{{message.content}}<|END_RESPONSE|><|END_OF_TURN_TOKEN|>{% endif %}\n    {% elif message.role|lower == 'tool' and message.tool_call_id not in tool_ids_seen.value %}\n<|START_OF_TURN_TOKEN|><|SYSTEM_TOKEN|><|START_TOOL_RESULT|>[\n{{ format_tool_message(messages, message) }}\n    {%- for msg in messages[loop.index0 + 1:] %}\n        {%- if msg.role|lower == 'tool' %},\n{{ format_tool_message(messages, msg) }}\n            {%- set tool_ids_seen.value = tool_ids_seen.value + [msg.tool_call_id] %}\n        {%- else %}\n            {%- break %}\n        {%- endif %}\n    {%- endfor %}\n\n]<|END_TOOL_RESULT|><|END_OF_TURN_TOKEN|>\n    {%- endif %}\n{%- endfor %}<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>"

# Qwen3 (hybrid thinking): reasoning split out of '<think>' blocks, a backwards scan for the last
# user query, enable_thinking.
QWEN3 = r'''{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\n\n' }}
    {%- endif %}
    {{- "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for forward_message in messages %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- set message = messages[index] %}
    {%- set tool_start = '<tool_response>' %}
    {%- set tool_start_length = tool_start|length %}
    {%- set start_of_message = message.content[:tool_start_length] %}
    {%- set tool_end = '</tool_response>' %}
    {%- set tool_end_length = tool_end|length %}
    {%- set start_pos = (message.content|length) - tool_end_length %}
    {%- if start_pos < 0 %}
        {%- set start_pos = 0 %}
    {%- endif %}
    {%- set end_of_message = message.content[start_pos:] %}
    {%- if ns.multi_step_tool and message.role == "user" and not(start_of_message == tool_start and end_of_message == tool_end) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {%- set content = message.content %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is defined and message.reasoning_content is not none %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in message.content %}
                {%- set content = (message.content.split('</think>')|last).lstrip('\n') %}
                {%- set reasoning_content = (message.content.split('</think>')|first).rstrip('\n') %}
                {%- set reasoning_content = (reasoning_content.split('<think>')|last).lstrip('\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\n<think>\n' + reasoning_content.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
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
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}'''


# Gemma 3 (google/gemma-3-*-it tokenizer_config.json): the system message becomes a prefix of the first
# user turn, content may be a list of text and image parts, and anything else is refused.
GEMMA3 = r'''{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- if messages[0]['content'] is string -%}
        {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}
    {%- else -%}
        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}
    {%- endif -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- elif message['content'] is iterable -%}
        {%- for item in message['content'] -%}
            {%- if item['type'] == 'image' -%}
                {{ '<start_of_image>' }}
            {%- elif item['type'] == 'text' -%}
                {{ item['text'] | trim }}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{ raise_exception("Invalid content type") }}
    {%- endif -%}
    {{ '<end_of_turn>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model\n'}}
{%- endif -%}
'''

# Phi-4 (microsoft/phi-4, 14B): ChatML turns with <|im_sep|> after the role and no newlines. This is the
# revision with add_generation_prompt; the first release appended '<|im_start|>assistant<|im_sep|>' to
# every user turn instead.
PHI4 = ("{% for message in messages %}{% if (message['role'] == 'system') %}{{'<|im_start|>system<|im_sep|>' + message['content'] + '<|im_end|>'}}"
        "{% elif (message['role'] == 'user') %}{{'<|im_start|>user<|im_sep|>' + message['content'] + '<|im_end|>'}}"
        "{% elif (message['role'] == 'assistant') %}{{'<|im_start|>assistant<|im_sep|>' + message['content'] + '<|im_end|>'}}{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant<|im_sep|>' }}{% endif %}")

# Phi-4-mini-instruct: tools are a JSON string in the system message's own 'tools' field (not the tools
# argument), and without a generation prompt the text ends with eos_token.
PHI4_MINI = ("{% for message in messages %}{% if message['role'] == 'system' and 'tools' in message and message['tools'] is not none %}"
             "{{ '<|' + message['role'] + '|>' + message['content'] + '<|tool|>' + message['tools'] + '<|/tool|>' + '<|end|>' }}"
             "{% else %}{{ '<|' + message['role'] + '|>' + message['content'] + '<|end|>' }}{% endif %}{% endfor %}"
             "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% else %}{{ eos_token }}{% endif %}")


FAMILIES = {
    # family: (chat_template as stored in tokenizer_config.json, bos, eos, flags)
    "chatml": (CHATML, "<s>", "<|im_end|>", {}),
    "llama2": (LLAMA2, "<s>", "</s>", {"alternating": True}),
    "llama3": (LLAMA3, "<|begin_of_text|>", "<|eot_id|>", {}),
    "llama3_1": (LLAMA31, "<|begin_of_text|>", "<|eot_id|>", {"tools": "llama"}),
    "qwen2_5": (QWEN25, None, "<|im_end|>", {"tools": "qwen"}),
    "mistral": (MISTRAL, "<s>", "</s>", {"alternating": True, "no_system": True}),
    "gemma2": (GEMMA2, "<bos>", "<eos>", {"alternating": True, "no_system": True}),
    "phi3_5": (PHI35, "<s>", "<|endoftext|>", {}),
    "deepseek_r1_distill": (DEEPSEEK_R1, "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", {"tools": "deepseek"}),
    "hermes3": ([{"name": "default", "template": HERMES_DEFAULT}, {"name": "tool_use", "template": HERMES_TOOL_USE}],
                "<|begin_of_text|>", "<|im_end|>", {"tools": "hermes"}),
    "mistral_small_3_1": (MISTRAL_SMALL_3_1, "<s>", "</s>", {"tools": "with_ids", "require_system": True}),
    "qwen3": (QWEN3, None, "<|im_end|>", {"tools": "qwen", "think": True}),
    "command_r7b": (COMMAND_R7B_TOOL_USE, "<BOS_TOKEN>", "<|END_OF_TURN_TOKEN|>", {"tools": "with_ids"}),
    "gemma3": (GEMMA3, "<bos>", "<eos>", {"alternating": True}),
    "phi4": (PHI4, "<|endoftext|>", "<|im_end|>", {}),
    "phi4_mini": (PHI4_MINI, "<|endoftext|>", "<|endoftext|>", {}),
}

SYSTEM = {"role": "system", "content": "You are a terse assistant."}
CONVERSATIONS = {
    "single_user": [{"role": "user", "content": "Hello!"}],
    "system_user": [SYSTEM, {"role": "user", "content": "What is 2+2?"}],
    "multi_turn": [SYSTEM, {"role": "user", "content": "Hi there."}, {"role": "assistant", "content": "Hello. How can I help?"},
                   {"role": "user", "content": "Tell me a joke."}],
    "multi_turn_no_system": [{"role": "user", "content": "One"}, {"role": "assistant", "content": "Two"},
                             {"role": "user", "content": "Three"}, {"role": "assistant", "content": "Four"}],
    "unicode": [{"role": "user", "content": "Grüße aus Köln 👋 — 日本語のテキスト, emoji 🧪🚀, ½ ∑ π"}],
    "whitespace": [{"role": "user", "content": "  leading and trailing spaces  \n\n\tand tabs\n  "},
                   {"role": "assistant", "content": "\nreply with newlines\n\n"}, {"role": "user", "content": " \n"}],
    "braces": [{"role": "user", "content": "{{ not a template }} {% if x %} {# comment #} '\"quotes\"' \\ backslash {}"}],
    "think": [{"role": "user", "content": "Think first."}, {"role": "assistant", "content": "<think>\nhmm\n</think>\n\nThe answer."},
              {"role": "user", "content": "Again."}],
    "alternation_broken": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}],
}

WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "description": "The city, e.g. Paris"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"], "description": "Temperature unit"},
        "days": {"type": "integer", "description": "  How many days  "}},
        "required": ["city"]}}}
TIME_TOOL = {"type": "function", "function": {
    "name": "get_time", "description": "Current time.", "parameters": {"type": "object", "properties": {}}}}


def tool_conversations(kind):
    args = {"city": "Zürich", "unit": "celsius"}
    if kind == "with_ids":  # templates that pair calls and results by id
        call = {"id": "call0a1b2c3d4", "type": "function", "function": {"name": "get_weather", "arguments": args}}
        return {
            "tools_user": ([SYSTEM, {"role": "user", "content": "Weather in Zürich?"}], [WEATHER_TOOL, TIME_TOOL]),
            "tools_call_and_result": ([SYSTEM, {"role": "user", "content": "Weather in Zürich?"},
                                       {"role": "assistant", "content": "", "tool_calls": [call]},
                                       {"role": "tool", "tool_call_id": "call0a1b2c3d4", "content": "{\"temperature\": 21}"},
                                       {"role": "assistant", "content": "It is 21 °C."}, {"role": "user", "content": "Thanks"}],
                                      [WEATHER_TOOL]),
        }
    if kind == "deepseek":  # this template concatenates arguments, so they must be a JSON string
        call = {"type": "function", "function": {"name": "get_weather", "arguments": json.dumps(args, ensure_ascii=False)}}
        call2 = {"type": "function", "function": {"name": "get_time", "arguments": "{}"}}
        calls = [call, call2]
    else:
        call = {"type": "function", "function": {"name": "get_weather", "arguments": args}}
        calls = [call]
    convs = {
        "tools_user": ([SYSTEM, {"role": "user", "content": "Weather in Zürich?"}], [WEATHER_TOOL, TIME_TOOL]),
        "tools_call_and_result": ([{"role": "user", "content": "Weather in Zürich?"},
                                   {"role": "assistant", "content": "" if kind != "deepseek" else None, "tool_calls": calls},
                                   {"role": "tool", "content": "{\"temperature\": 21, \"sky\": \"clear\"}"}]
                                  + ([{"role": "tool", "content": "12:00"}] if kind == "deepseek" else [])
                                  + [{"role": "assistant", "content": "It is 21 °C and clear."},
                                     {"role": "user", "content": "Thanks"}],
                                  [WEATHER_TOOL]),
    }
    return convs


def family_cases(family):
    """Cases for what one template does beyond the shared conversations: (name, messages,
    add_generation_prompt, tools, extra keyword arguments)."""
    weather = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Zürich", "unit": "celsius"}}}
    out = []
    if family == "qwen3":
        think = CONVERSATIONS["think"]
        out += [("think_disabled", think, True, None, {"enable_thinking": False}),
                ("think_enabled", think, True, None, {"enable_thinking": True}),
                ("think_after_tool_response",
                 think[:2] + [{"role": "user", "content": "<tool_response>\nx\n</tool_response>"}], False, None, {})]
        # reasoning_content as the OpenAI-style field: dropped before the last user query, kept after it.
        answered = {"role": "assistant", "content": "The answer.", "reasoning_content": "\nhmm, 2 + 2\n"}
        out += [("reasoning_content_in_history_gen", [think[0], answered, think[2]], True, None, {}),
                ("reasoning_content_last_turn_nogen", [think[0], answered], False, None, {}),
                ("reasoning_content_none_falls_back_to_think_tags",
                 [think[0], {"role": "assistant", "content": "<think>\nplan\n</think>\n\nDone.", "reasoning_content": None}],
                 False, None, {}),
                ("multi_turn_think_disabled_gen", CONVERSATIONS["multi_turn"], True, None, {"enable_thinking": False}),
                ("multi_turn_think_disabled_nogen", CONVERSATIONS["multi_turn"], False, None, {"enable_thinking": False})]
        # An agent loop after the last user query: the call's reasoning is kept, results go back as user turns.
        ask = {"role": "user", "content": "Weather in Zürich?"}
        call = {"role": "assistant", "content": "", "reasoning_content": "I need the weather tool.", "tool_calls": [weather]}
        result = {"role": "tool", "content": "{\"temperature\": 21}"}
        for name, extra in (("tool_loop_reasoning_gen", {}), ("tool_loop_reasoning_think_disabled_gen", {"enable_thinking": False})):
            out.append((name, [SYSTEM, ask, call, result], True, [WEATHER_TOOL], extra))
        two_calls = {"role": "assistant", "content": "Let me check both.", "tool_calls": [
            weather, {"type": "function", "function": {"name": "get_time", "arguments": "{\"tz\": \"CET\"}"}}]}
        out.append(("tool_loop_two_calls_then_answer_nogen",
                    [ask, two_calls, result, {"role": "tool", "content": "12:00"},
                     {"role": "assistant", "content": "<think>\nok\n</think>\n\nIt is 21 °C at noon."}],
                    False, [WEATHER_TOOL, TIME_TOOL], {}))
    if family == "llama3_1":
        messages, tools = tool_conversations("llama")["tools_user"]
        out.append(("tools_in_system_extra_args", messages, True, tools,
                    {"date_string": "01 Jan 2025", "tools_in_user_message": False}))
    if family == "gemma3":
        image_then_text = [{"type": "image"}, {"type": "text", "text": "  Describe this image.  "}]
        out += [("image_and_text_parts_gen", [{"role": "user", "content": image_then_text}], True, None, {}),
                ("two_images_multi_turn_gen",
                 [{"role": "system", "content": [{"type": "text", "text": "You see images."}]},
                  {"role": "user", "content": [{"type": "text", "text": "Compare"}, {"type": "image"}, {"type": "image"}]},
                  {"role": "assistant", "content": [{"type": "text", "text": "The first is darker."}]},
                  {"role": "user", "content": "Why?"}], True, None, {}),
                ("system_only_nogen", [SYSTEM], False, None, {}),
                ("content_none_raises", [{"role": "user", "content": None}], True, None, {}),
                ("system_then_assistant_raises", [SYSTEM, {"role": "assistant", "content": "Hi"}], True, None, {})]
    if family == "phi4":
        out.append(("tool_role_is_dropped_gen", [{"role": "user", "content": "Weather?"}, {"role": "tool", "content": "21"},
                                                 {"role": "assistant", "content": "21 °C."}], True, None, {}))
    if family == "phi4_mini":
        tools = json.dumps([WEATHER_TOOL["function"], TIME_TOOL["function"]], ensure_ascii=False)
        with_tools = {"role": "system", "content": "You are a helpful assistant with some tools.", "tools": tools}
        out += [("tools_in_system_message_gen", [with_tools, {"role": "user", "content": "Weather in Zürich?"}], True, None, {}),
                ("tools_call_and_result_nogen",
                 [with_tools, {"role": "user", "content": "Weather in Zürich?"},
                  {"role": "assistant", "content": "<|tool_call|>[{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Zürich\"}}]<|/tool_call|>"},
                  {"role": "tool", "content": "{\"temperature\": 21}"}, {"role": "assistant", "content": "It is 21 °C."}],
                 False, None, {}),
                ("tools_none_is_plain_system_gen",
                 [{"role": "system", "content": "No tools.", "tools": None}, {"role": "user", "content": "Hi"}], True, None, {}),
                ("tools_argument_is_not_rendered_gen", [{"role": "user", "content": "Weather?"}], True, [WEATHER_TOOL], {})]
    return out


def make_tokenizer(template, bos, eos):
    vocab = {"<unk>": 0}
    for t in (bos, eos):
        if t is not None:
            vocab[t] = len(vocab)
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel(vocab, unk_token="<unk>")), unk_token="<unk>",
                                  bos_token=bos, eos_token=eos)
    if isinstance(template, list):
        tok.chat_template = {t["name"]: t["template"] for t in template}
    else:
        tok.chat_template = template
    return tok


def render(tok, messages, add_generation_prompt, tools, extra):
    try:
        out = tok.apply_chat_template(messages, tools=tools, add_generation_prompt=add_generation_prompt, tokenize=False, **extra)
        return {"expected": out}
    except jinja2.exceptions.TemplateError as e:
        return {"error": str(e)}
    except (TypeError, ValueError) as e:  # Python errors inside the template (e.g. iterating None)
        return {"error": str(e)}


def main():
    print(f"transformers {transformers.__version__}, jinja2 {jinja2.__version__}", file=sys.stderr)
    for family, (template, bos, eos, flags) in FAMILIES.items():
        tok = make_tokenizer(template, bos, eos)
        cases = []
        for name, messages in CONVERSATIONS.items():
            if name == "think" and family != "deepseek_r1_distill" and not flags.get("think"):
                continue
            if flags.get("require_system") and messages[0]["role"] != "system":
                messages = [SYSTEM] + messages
            for agp in (True, False):
                case = {"name": f"{name}_{'gen' if agp else 'nogen'}", "messages": messages, "add_generation_prompt": agp,
                        "tools": None, "extra": {}}
                case.update(render(tok, messages, agp, None, {}))
                cases.append(case)
        if "tools" in flags:
            for name, (messages, tools) in tool_conversations(flags["tools"]).items():
                for agp in (True, False):
                    case = {"name": f"{name}_{'gen' if agp else 'nogen'}", "messages": messages, "add_generation_prompt": agp,
                            "tools": tools, "extra": {}}
                    case.update(render(tok, messages, agp, tools, {}))
                    cases.append(case)
        for name, messages, agp, tools, extra in family_cases(family):
            case = {"name": name, "messages": messages, "add_generation_prompt": agp, "tools": tools, "extra": extra}
            case.update(render(tok, messages, agp, tools, extra))
            cases.append(case)
        d = os.path.join(OUT, family)
        os.makedirs(d, exist_ok=True)
        config = {"bos_token": bos, "eos_token": eos, "unk_token": "<unk>", "chat_template": template,
                  "tokenizer_class": "PreTrainedTokenizerFast"}
        with open(os.path.join(d, "tokenizer_config.json"), "w", encoding="utf-8") as f:
            json.dump(config, f, ensure_ascii=False, indent=2)
            f.write("\n")
        with open(os.path.join(d, "cases.json"), "w", encoding="utf-8") as f:
            json.dump({"generator": f"transformers {transformers.__version__}, jinja2 {jinja2.__version__}", "cases": cases},
                      f, ensure_ascii=False, indent=1)
            f.write("\n")
        n_err = sum(1 for c in cases if "error" in c)
        print(f"{family}: {len(cases)} cases ({n_err} raise)", file=sys.stderr)




# --- snippets: small templates, each exercising one engine feature, rendered by the very jinja
# environment apply_chat_template compiles with (transformers' _compile_jinja_template), written to
# tests/fixtures/chat_template_snippets.json ---
SNIPPETS = [
    # whitespace control: trim_blocks, lstrip_blocks, -/+ modifiers, comments, trailing newline
    ("{% if true %}\n  yes\n  {% endif %}\nend", {}),
    ("{% for x in [1, 2] %}\n    {{ x }}\n{% endfor %}\n", {}),
    ("a  \n {{- 'b' -}} \n c", {}),
    ("  {%+ if true %}x{% endif %}  {% if true %}y{% endif %}", {}),
    ("x\n\n", {}),
    ("x\r\ny\rz", {}),
    ("a{# c #}\nb {#- c -#} c\n  {# indented #}\nd", {}),
    ("{%- if true -%}\n\n  a  \n\n{%- endif -%}\n\nb", {}),
    ("line\n    {%- set x = 1 %}\n    {{ x }}\n", {}),
    ("{% if true %}  {% endif %}|{% if true %}\n  {% endif %}|", {}),
    ("{{ 'a' }}\n{{ 'b' }}\n", {}),
    ("{% raw %}{{ x }}{% endraw %}", {}),
    ("  {% for m in ms %}\n  - {{ m }}\n  {% endfor %}\n", {"ms": ["a", "b"]}),
    ("{% macro f(x) %}\n  [{{ x }}]\n{% endmacro %}\n{{ f(1) }}{{ f(2) }}", {}),
    # expressions and operators
    ("{{ 1 + 2 * 3 }} {{ 2 ** 3 ** 2 }} {{ 7 // 2 }} {{ -7 // 2 }} {{ -7 % 3 }} {{ 7 / 2 }} {{ 6 / 3 }}", {}),
    ("{{ 'a' ~ 1 * 2 }} {{ 1 ~ none ~ true }} {{ 'x' * 3 }} {{ [1] + [2] }}", {}),
    ("{{ not 1 == 2 }} {{ 0 or 'x' }} {{ 1 and 'y' }} {{ [] or none }} {{ 1 if 0 else 2 }} {{ 'z' if false }}|", {}),
    ("{{ 1 == 1.0 }} {{ 1 != '1' }} {{ 'a' < 'b' }} {{ [1, 2] < [1, 3] }} {{ true == 1 }}", {}),
    ("{{ 1 < 2 < 3 }} {{ 3 > 2 > 2 }} {{ 1 < 3 > 2 }} {{ 1 == 1 != 2 }} {{ 'a' in 'ab' in 'abc' }}", {}),
    ("{{ 'b' in 'abc' }} {{ 2 in [1, 2] }} {{ 'k' in {'k': 1} }} {{ 'z' not in 'abc' }} {{ 'k' in d }}", {"d": {"k": None}}),
    ("{{ 1.0 }} {{ 0.1 + 0.2 }} {{ 1e20 }} {{ 1e-5 }} {{ 2.5e-3 }} {{ 1e16 }} {{ -0.0 }} {{ 10 / 4 }}", {}),
    ("{{ [1, 'a', none, true, 1.5, {'k': [1]}] }} {{ {'a': 'it\\'s'} }} {{ none }} {{ true }}", {}),
    ("{{ x }}|{{ x.y is defined }}|{{ d.missing }}|{{ d['missing'] }}|{{ l[5] }}", {"d": {}, "l": []}),
    # strings
    ("{{ '  a b  '.strip() }}|{{ 'xxaxx'.strip('x') }}|{{ ' a '.lstrip() }}|{{ ' a '.rstrip() }}|{{ '\u3000a\u00a0'.strip() }}", {}),
    ("{{ 'a,b,,c'.split(',') }} {{ ' a  b '.split() }} {{ 'a b c'.split(' ', 1) }} {{ 'a<x>b'.split('<x>')[-1] }}", {}),
    ("{{ 'abc'.startswith('ab') }} {{ 'abc'.endswith(('x', 'c')) }} {{ 'aXb'.upper() }} {{ 'aXb'.lower() }}", {}),
    ("{{ 'hello wORLD-x'.title() }}|{{ 'hello wORLD-x (y)' | title }}|{{ 'hELLO' | capitalize }}|{{ 'hELLO'.capitalize() }}", {}),
    ("{{ 'grüne äpfel ǆ' | upper }}|{{ 'ÄÖÜ Σ'.lower() }}|{{ 'élan vital ǆx'.title() }}|{{ 'éA' | capitalize }}|{{ 'über-ärger' | title }}", {}),
    ("{{ 'aaa'.replace('a', 'b', 2) }} {{ 'x-y' | replace('-', '+') }} {{ 'abc'.find('c') }} {{ 'a\\nb'.splitlines() }}", {}),
    ("{{ 'héllo'[1:3] }} {{ 'héllo'[-1] }} {{ [1, 2, 3, 4][::-1] }} {{ [1, 2, 3][-1] }} {{ 'abc'[-2:] }} {{ [1,2,3,4,5][1::2] }}", {}),
    ("{{ 'a\\tb\\u00e9\\x41\\\\' }} {{ \"d'q\" }} {{ 'adj' 'acent' }}", {}),
    ("{{ '{{ braces }}' }} {{ '{% tag %}' }}", {}),
    # filters
    ("{{ [3, 1, 2] | sort | join(',') }} {{ ['b', 'A', 'c'] | sort }} {{ [3, 1] | sort(reverse=true) }} {{ [1, 2, 1] | unique | list }}", {}),
    ("{{ ['a', 'b'] | first }} {{ ['a', 'b'] | last }} {{ 'héllo' | length }} {{ {'a': 1} | length }} {{ x | length }}", {}),
    ("{{ x | default('d') }} {{ '' | default('e', true) }} {{ none | string }} {{ '7' | int + 1 }} {{ 'x' | int }} {{ 1.5 | string }} {{ '2.5' | float }}", {}),
    ("{{ [{'a': 1}, {'a': 2}] | map(attribute='a') | list }} {{ ['a', 'b'] | map('upper') | join }}", {}),
    ("{{ [1, 2, 3] | select('odd') | list }} {{ ['a', 'code', 'b'] | reject('equalto', 'code') | join }} {{ [0, 1, ''] | select | list }}", {}),
    ("{{ ms | selectattr('role', 'equalto', 'user') | list | length }} {{ ms | rejectattr('role', 'equalto', 'user') | map(attribute='content') | join('/') }}", {"ms": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}]}),
    ("{{ 'a\\nb\\n\\nc' | indent(2) }}|{{ 'a\\nb' | indent(2, true) }}|{{ 'a\\n\\nb' | indent(3, blank=true) }}", {}),
    ("{{ d | items | list }} {{ d.items() | list }} {{ d.keys() | list }} {{ d.values() | list }} {{ d.get('a') }} {{ d.get('z', 0) }} {{ x | items | list }}", {"d": {"a": 1, "b": [2]}}),
    ("{{ [1, 2, 3] | sum }} {{ [3, 1] | min }} {{ [3, 1] | max }} {{ -3 | abs }} {{ 2.567 | round(2) }} {{ [1, 2] | reverse | list }} {{ 'abc' | reverse }}", {}),
    ("{{ ' x ' | trim }}|{{ 'xxyxx' | trim('x') }}|{{ 'a b' | upper }}|{{ 'A B' | lower }}|{{ 'a b c' | wordcount }}", {}),
    ("{{ {'b': 1, 'a': 2} | dictsort }} {{ [1, 2, 3, 4, 5] | batch(2) | list }}", {}),
    # tojson as transformers overrides it
    ("{{ x | tojson }}", {"x": {"b": 1, "a": [1.5, None, True, "é\"\n</script>", 10**18]}}),
    ("{{ x | tojson(indent=2) }}", {"x": {"a": [1, 2], "e": {}, "l": [], "n": {"k": "v"}}}),
    ("{{ x | tojson(ensure_ascii=true) }} {{ x | tojson(ensure_ascii=false) }}", {"x": "é😀\u0001"}),
    ("{{ {'b': 1, 'a': 2} | tojson(sort_keys=true) }} {{ [1, 2] | tojson(separators=(',', ':')) }} {{ 'x' | tojson }}", {}),
    # tests
    ("{{ x is defined }} {{ x is not defined }} {{ none is none }} {{ 'a' is string }} {{ {} is mapping }} {{ [] is sequence }}", {}),
    ("{{ 'a' is iterable }} {{ 1 is iterable }} {{ x is iterable }} {{ 3 is divisibleby 3 }} {{ 2 is number }} {{ true is boolean }} {{ 1 is integer }} {{ 1.0 is float }}", {}),
    ("{{ 2 is even }} {{ 3 is odd }} {{ 'ab' is lower }} {{ 'AB' is upper }} {{ 1 is eq 1 }} {{ 1 is ne 2 }} {{ 1 is lt 2 }} {{ 'a' is in 'abc' }} {{ x is none }}", {}),
    # statements
    ("{% for x in [1, 2, 3] %}{{ loop.index }}{{ loop.index0 }}{{ loop.revindex }}{{ loop.revindex0 }}{{ loop.first }}{{ loop.last }}{{ loop.length }};{% endfor %}", {}),
    ("{% for x in [1, 2, 3, 4] if x is even %}{{ x }}/{{ loop.length }}/{{ loop.last }} {% endfor %}", {}),
    ("{% for x in [] %}a{% else %}empty{% endfor %} {% for x in none or [] %}{% endfor %}", {}),
    ("{% for k, v in {'a': 1, 'b': 2}.items() %}{{ k }}={{ v }},{% endfor %}{% for k in {'x': 1} %}{{ k }}{% endfor %}", {}),
    ("{% for x in [1, 2, 3] %}{% if x == 2 %}{% continue %}{% endif %}{{ x }}{% endfor %}{% for x in [1, 2, 3] %}{% if x == 2 %}{% break %}{% endif %}{{ x }}{% endfor %}", {}),
    ("{% for x in 'ab' %}{{ loop.previtem is defined }}{{ loop.nextitem }}{{ loop.cycle('o', 'e') }}{% endfor %}", {}),
    ("{% set x = 1 %}{% for i in [1] %}{% set x = 2 %}{{ x }}{% endfor %}{{ x }}", {}),
    ("{% set ns = namespace(x=1, s='') %}{% for i in [1, 2] %}{% set ns.x = ns.x + i %}{% set ns.s = ns.s ~ i %}{% endfor %}{{ ns.x }}{{ ns.s }}", {}),
    ("{% if true %}{% set y = 'in if' %}{% endif %}{{ y }} {% set a, b = 1, 2 %}{{ b }}{{ a }} {% set s %}block {{ 1 }}{% endset %}[{{ s }}]", {}),
    ("{% if 0 %}a{% elif none %}b{% elif 'x' %}c{% else %}d{% endif %}", {}),
    ("{% macro hi(name, p='!') %}hi {{ name }}{{ p }}{% endmacro %}{{ hi('a') }} {{ hi('b', p='?') }} {{ hi(name='c') }}", {}),
    ("{% macro f(n) %}{% if n > 0 %}{{ n }}{{ f(n - 1) }}{% endif %}{% endmacro %}{{ f(3) }}", {}),
    ("{{ range(3) | list }} {{ range(1, 6, 2) | join }} {{ dict(a=1).a }} {{ namespace(a=1).a }}", {}),
    ("{% set m = messages[1:] %}{{ m | length }} {{ messages[0]['role'] }} {{ messages[0].role }} {{ messages[-1].content }}", {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]}),
    ("{% generation %}gen{% endgeneration %}", {}),
    # errors
    ("{{ raise_exception('Custom: ' ~ 42) }}", {}),
    ("{% if messages[0].role != 'user' %}{{ raise_exception('first must be user') }}{% endif %}ok", {"messages": [{"role": "system"}]}),
]


def make_snippets():
    from transformers.utils.chat_template_utils import _compile_jinja_template
    out = []
    for source, variables in SNIPPETS:
        entry = {"template": source, "vars": variables}
        try:
            entry["expected"] = _compile_jinja_template(source).render(**variables)
        except jinja2.exceptions.TemplateError as e:
            entry["error"] = str(e)
        out.append(entry)
    path = os.path.join(ROOT, "tests", "fixtures", "chat_template_snippets.json")
    with open(path, "w", encoding="utf-8") as f:
        json.dump({"generator": f"transformers {transformers.__version__}, jinja2 {jinja2.__version__}", "snippets": out},
                  f, ensure_ascii=False, indent=1)
        f.write("\n")
    print(f"snippets: {len(out)} ({sum(1 for e in out if 'error' in e)} raise)", file=sys.stderr)


if __name__ == "__main__":
    main()
    make_snippets()
