"""Debug instrumentation: off by default, free when off, never inline in the hot path.

- `checks`: SGLANG_DEBUG_CHECKS invariant checks (they sync or pass over data; never under
  CUDA-graph capture), and SGLANG_CP_POISON_PADDING (garbage in CP dummy rows, to prove no real
  row reads them).
"""
