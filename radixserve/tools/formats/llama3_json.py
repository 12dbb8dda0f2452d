"""llama3_json: Llama 3.1 - 3.3 (JSON tool calling). Calls open the output (after an optional
`<|python_tag|>`), `; ` between them:

    {"name": "get_weather", "parameters": {"city": "Paris"}}
"""

from radixserve.tools.formats.json_calls import JsonCallFormat

LLAMA3_JSON = JsonCallFormat(
    name="llama3_json", open="", close="", args_key="parameters", separator="; ", anywhere=False,
    strip_prefixes=("<|python_tag|>",),
)
