"""Tools the tool-calling tests share: two functions with bounded schemas, and the family
templates of tests/templates (one per tool-call format)."""

from pathlib import Path

TEMPLATES = Path(__file__).parent / "templates"
FORMAT_FAMILIES = ["hermes", "llama3_json", "pythonic", "mistral", "qwen3_coder", "deepseek_v3", "harmony"]
WEATHER_SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                   "unit": {"enum": ["c", "f"]}},
                  "required": ["city", "unit"], "additionalProperties": False}
ADD_SCHEMA = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 999},
                                               "b": {"type": "integer", "minimum": 0, "maximum": 999}},
              "required": ["a", "b"], "additionalProperties": False}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                      "parameters": WEATHER_SCHEMA}},
    {"type": "function", "function": {"name": "add", "description": "Add two integers", "parameters": ADD_SCHEMA}},
]
SCHEMAS = {"get_weather": WEATHER_SCHEMA, "add": ADD_SCHEMA}
