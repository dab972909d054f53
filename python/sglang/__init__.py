"""SGLang fork for DeepSeek Sparse Attention models (DeepSeek-V3.2, GLM-5)."""

from sglang.version import __version__


def __getattr__(name):
    # Lazy: `import sglang` stays cheap (no torch import) for CLI tools and clients.
    if name == "Engine":
        from sglang.srt.entrypoints.engine import Engine

        return Engine
    raise AttributeError(name)


__all__ = ["Engine", "__version__"]
