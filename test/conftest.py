import os

import pytest

# Builtin tiny models are materialised once per machine (then cached) -- never downloaded.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(scope="session")
def builtin_path():
    from sglang.srt.model_loader.builtin import resolve_model_path

    return lambda name: resolve_model_path(f"builtin:{name}")
