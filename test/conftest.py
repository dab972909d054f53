import os

import pytest

# One CPU thread per process, here and in the servers / benchmark scripts the tests start (they
# inherit it): the suite runs a client and its servers side by side on a shared 2-core machine,
# where OpenMP (torch) and OpenBLAS (numpy: the Triton interpreter) threads spin-wait for peers
# that are descheduled. A --disable-overlap-schedule server decoded 200 tokens in 112 s with the
# default 2 threads, 2.9 s with 1. Set OMP_NUM_THREADS to choose otherwise. (Neither torch nor
# numpy is imported yet when pytest loads this file.)
os.environ.setdefault("OMP_NUM_THREADS", "1")
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
