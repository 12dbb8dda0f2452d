"""hermes: Hermes 2 Pro, Qwen 2.5, Qwen 3, QwQ. Each call stands alone, anywhere after content:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>
"""

from radixserve.tools.formats.json_calls import JsonCallFormat

HERMES = JsonCallFormat(
    name="hermes", open="<tool_call>", close="</tool_call>", args_key="arguments", separator="\n", anywhere=True
)
