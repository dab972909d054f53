"""Generate text offline from the command line:

    python -m sglang.generate --model-path builtin:tiny-deepseek-v32 --prompt "Hello" [--max-new-tokens 32]

Every ServerArgs flag is accepted (--dtype, --page-size, --nsa-index-k-dtype, ...).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys


def main(argv: list[str] | None = None) -> int:
    from sglang.srt.server_args import ServerArgs, ServerArgsError

    parser = argparse.ArgumentParser(prog="python -m sglang.generate", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    ServerArgs.add_cli_args(parser)
    g = parser.add_argument_group("generation")
    g.add_argument("--prompt", action="append", required=True, help="Prompt text (repeat for a batch).")
    g.add_argument("--max-new-tokens", type=int, default=32)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=None, help="Per-request sampling seed.")
    args = parser.parse_args(argv)
    from sglang.srt.entrypoints.engine import Engine

    kwargs = {f.name: getattr(args, f.name) for f in dataclasses.fields(ServerArgs)}
    try:
        engine = Engine(**kwargs)
    except (ServerArgsError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    sp = {"max_new_tokens": args.max_new_tokens, "temperature": args.temperature, "top_p": args.top_p,
          "seed": args.seed}
    for prompt, out in zip(args.prompt, engine.generate(list(args.prompt), sp)):
        meta = out["meta_info"]
        print(f"=== prompt: {prompt!r}")
        print(out["text"])
        print(f"--- {meta['completion_tokens']} tokens, finish: {meta['finish_reason']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
