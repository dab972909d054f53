"""python -m sglang.launch_server --model-path <HF dir | builtin:NAME> [--port 30000] [...]"""

import sys

from sglang.srt.entrypoints.launch import main

if __name__ == "__main__":
    sys.exit(main())
