"""How tools reach a model whose chat template takes no ``tools`` argument: in the system message.

The text states the tools (their OpenAI function definitions, one JSON object a line, inside
<tools></tools>) and the call format the router's HTTP face parses back (hermes style, as Qwen's
and NousResearch's templates write it):

    <tool_call>
    {"name": "<function name>", "arguments": {<arguments as a JSON object>}}
    </tool_call>

It is put before the chat's own system message, or becomes the system message when there is none.
"""
from __future__ import annotations

import json
from typing import Any

TOOLS_SYSTEM_PROMPT = (
    "You may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n{{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}}\n</tool_call>")


def template_takes_tools(chat_template: str | None) -> bool:
    """Whether a chat template reads the ``tools`` variable (a Jinja template that never names it ignores it)."""
    return bool(chat_template) and "tools" in str(chat_template)


def with_tools_in_system(messages: list[dict[str, str]], tools: list[Any]) -> list[dict[str, str]]:
    text = TOOLS_SYSTEM_PROMPT.format(tools="\n".join(json.dumps(t) for t in tools))
    if messages and messages[0]["role"] == "system":
        return [{"role": "system", "content": text + "\n\n" + messages[0]["content"]}, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]
