"""Debug instrumentation: off by default, free when off, never inline in the hot path.

- `checks`: SGLANG_DEBUG_CHECKS invariant checks (they sync or pass over data; never under
  CUDA-graph capture), and SGLANG_CP_POISON_PADDING (garbage in CP dummy rows, to prove no real
  row reads them).
- `kv_trace`: SGLANG_CP_HICACHE_KV_TRACE=1..3 hashes of KV / indexer-K pages at HiCache backup and
  reload, and per-layer forward hashes of eager extends; `kv_trace_analyze` (a CLI) names the
  first diverging stage and layer.
- `hooks`: `install_debug_hooks(model)` puts the forward-side parts of both on a built model as
  forward hooks (the model loader calls it); nothing is installed when the environment is unset.
"""
