"""Pure-text output parsers (reasoning blocks); see reasoning_parser.py."""
