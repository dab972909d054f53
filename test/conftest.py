import os

import pytest

# Builtin tiny models are materialised once per machine (then cached) -- never downloaded.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# Triton kernels run on CPU under Triton's interpreter; it must be chosen before any kernel module
# is imported (triton.jit decides at decoration time). GPU runs (SGLANG_TEST_DEVICE=cuda) compile.
if os.environ.get("SGLANG_TEST_DEVICE", "cpu") != "cuda":
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def builtin_path():
    from sglang.srt.model_loader.builtin import resolve_model_path

    return lambda name: resolve_model_path(f"builtin:{name}")


def pytest_configure(config):
    # The suite has a time budget (README): every run lists its slowest tests, unless asked otherwise.
    if getattr(config.option, "durations", None) is None:
        config.option.durations = 25
