"""MoE layers: router / top-k, FusedMoE, expert runners and token dispatchers.

Runners and dispatchers are registered by name in moe_registry.py (import-light: ServerArgs reads
the --moe-runner-backend choices from there)."""
