"""MoE layers. Runner names (the --moe-runner-backend choices) live here, import-light."""

MOE_RUNNER_BACKENDS = ["auto", "torch", "triton"]


def resolve_moe_runner_backend(name: str, device: str) -> str:
    """auto: the Triton fused MoE on CUDA, the torch reference loop on CPU."""
    if name == "auto":
        return "triton" if device == "cuda" else "torch"
    return name
