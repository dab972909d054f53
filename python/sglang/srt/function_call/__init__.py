"""Tool-call parsers: model-specific tool-call markup -> OpenAI tool calls (see function_call_parser.py)."""
