"""ModelRunner's side of the memory plan on CPU: the profile forward of the largest step (its batch
equals a plain prefill of the same tokens, and it leaves the runner's own pools alone), the GPU
planning path with the device's numbers faked (profile vs arithmetic, the profile running out of
memory), the draft's weights counted before it loads, and the CPU pool sizing unchanged."""

from __future__ import annotations

import os

import pytest
import torch

from sglang.srt.configs.model_config import ModelConfig
from sglang.srt.model_executor import memory_profile
from sglang.srt.model_executor.memory_plan import GiB, MemoryPlanError, draft_memory_needs
from sglang.srt.model_executor.memory_profile import profile_requests, run_profile_forward
from sglang.srt.model_executor.model_runner import ModelRunner
from sglang.srt.model_loader.loader import get_model, model_weight_bytes
from sglang.srt.model_loader.tiny_models import make_tiny_checkpoint
from sglang.srt.server_args import ServerArgs
from sglang.srt.testing.runner_utils import prefill_all_logits

CTX = 64


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint(str(tmp_path_factory.mktemp("memplan") / "v32"), arch="deepseek_v32", mtp_layer=True)


@pytest.fixture(scope="module")
def runner(ckpt):
    sa = ServerArgs(model_path=ckpt, dtype="float32", device="cpu", max_total_tokens=512, context_length=CTX,
                    chunked_prefill_size=128).resolve()
    return ModelRunner(ModelConfig(ckpt, "float32", context_length=CTX), sa)


def test_profile_requests_end_at_the_context_length():
    assert profile_requests(8192, 163840) == [(163840 - 8192, 8192)]
    assert profile_requests(100, 64) == [(0, 64), (28, 36)]
    assert sum(n for _, n in profile_requests(1000, 64)) == 1000


def test_profile_forward_is_a_prefill_of_its_tokens(runner):
    """128 tokens over a 64-token context: two whole requests with no prefix, i.e. exactly a plain
    prefill of the same ids; the runner's own pools are not touched."""
    kv = [b.clone() for b in runner.token_to_kv_pool.kv_buffer]
    pools = (runner.req_to_token_pool, runner.token_to_kv_pool)
    out = run_profile_forward(runner, 128, CTX, seed=3)
    assert (runner.req_to_token_pool, runner.token_to_kv_pool) == pools
    assert all(torch.equal(a, b) for a, b in zip(kv, runner.token_to_kv_pool.kv_buffer))
    ids = torch.randint(0, runner.model_config.vocab_size, (128,), generator=torch.Generator().manual_seed(3))
    ref = prefill_all_logits(runner, [ids[:64].tolist(), ids[64:].tolist()])
    torch.testing.assert_close(out.next_token_logits, torch.stack([r[-1] for r in ref]), rtol=1e-5, atol=1e-5)


def test_profile_forward_over_a_prefix_of_the_padding_page(runner):
    out = run_profile_forward(runner, 100, CTX)  # the second request's 36 rows end at position 63
    assert out.next_token_logits.shape == (2, runner.model_config.vocab_size)
    assert torch.isfinite(out.next_token_logits).all()


def _fake_device(monkeypatch, free: int, total: int, measured, runner=None):
    """A GPU of `total` bytes with `free` left after the weights; the profile forward measures
    `measured` bytes (or raises it). The runner's --max-total-tokens is lifted for the call."""
    if runner is not None:
        monkeypatch.setattr(runner.server_args, "max_total_tokens", None)
    calls = []
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: calls.append("mem_get_info") or (free, total))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty_cache"))

    def profile(runner, tokens, ctx):
        if isinstance(measured, BaseException):
            raise measured
        return measured

    monkeypatch.setattr(memory_profile, "profile_step_peak", profile)
    return calls


@pytest.mark.parametrize("measured_gib", [0.001, 3.0])
def test_gpu_plan_takes_the_larger_of_profile_and_arithmetic(runner, monkeypatch, measured_gib):
    calls = _fake_device(monkeypatch, free=20 * GiB, total=24 * GiB, measured=int(measured_gib * GiB), runner=runner)
    plan = runner.plan_device_memory(runner._bytes_per_token())
    # free memory is read only once the allocator gave back what loading left cached
    assert calls and all(calls[i - 1] == "empty_cache" for i, c in enumerate(calls) if c == "mem_get_info")
    assert plan.activations >= int(measured_gib * GiB)
    if measured_gib > 1:  # the tiny model's arithmetic is a few MB: the profile decides
        assert plan.activations == int(measured_gib * GiB)
    assert plan.step_tokens == 128 and plan.cuda_graphs == 0  # CPU backends: no graphs planned
    assert plan.free_after_kv >= plan.reserve and plan.kv_tokens > 0


def test_gpu_plan_profile_out_of_memory_names_the_flags(runner, monkeypatch):
    _fake_device(monkeypatch, free=20 * GiB, total=24 * GiB, measured=torch.OutOfMemoryError("CUDA out of memory"))
    with pytest.raises(MemoryPlanError, match="--chunked-prefill-size"):
        runner.plan_device_memory(runner._bytes_per_token())


def test_gpu_plan_counts_the_draft_before_it_loads(runner, monkeypatch):
    _fake_device(monkeypatch, free=4 * GiB, total=8 * GiB, measured=0, runner=runner)
    base = runner.plan_device_memory(runner._bytes_per_token())
    with_draft = runner.plan_device_memory(runner._bytes_per_token(), extra_weight_bytes=GiB // 4,
                                           extra_reserve_bytes=GiB // 8)
    assert with_draft.weights == base.weights + GiB // 4
    assert with_draft.cuda_graphs == base.cuda_graphs + GiB // 8
    assert with_draft.kv_tokens < base.kv_tokens


def test_model_weight_bytes_is_what_loading_allocates(ckpt):
    for mc in (ModelConfig(ckpt, "float32"), ModelConfig(ckpt, "bfloat16", is_draft_model=True)):
        model = get_model(mc, "cpu", load_format="dummy")
        loaded = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
        assert model_weight_bytes(mc) == loaded
    sa = ServerArgs(model_path=ckpt, device="cpu").resolve()
    weights, graphs = draft_memory_needs(ModelConfig(ckpt, "bfloat16", is_draft_model=True), sa,
                                         runner_group())
    assert weights == model_weight_bytes(ModelConfig(ckpt, "bfloat16", is_draft_model=True)) and graphs > 0


def runner_group():
    from sglang.srt.distributed.parallel_state import SINGLE_GROUP

    return SINGLE_GROUP


def test_cpu_pool_sizing_is_unchanged(ckpt):
    """CPU keeps its fixed byte budget (no device plan): the same tokens as before the plan."""
    from sglang.srt.model_executor.model_runner import CPU_KV_BUDGET_BYTES

    sa = ServerArgs(model_path=ckpt, dtype="float32", device="cpu").resolve()
    r = ModelRunner(ModelConfig(ckpt, "float32"), sa)
    assert r.memory_plan is None
    per = r._bytes_per_token()
    assert r.max_total_num_tokens <= CPU_KV_BUDGET_BYTES // per and r.max_total_num_tokens > 0



def _rank_capacity(rank: int, port: int, ckpt: str, queue) -> None:
    """One of 2 gloo ranks whose own budgets differ (as free memory differs per GPU)."""
    try:
        from sglang.srt.distributed.parallel_state import init_distributed

        torch.set_num_threads(1)
        group = init_distributed(2, rank, f"tcp://127.0.0.1:{port}", "gloo", timeout_s=300)
        ModelRunner.profile_max_num_tokens = lambda self, *a, **k: 4096 + 1024 * rank
        sa = ServerArgs(model_path=ckpt, dtype="float32", device="cpu", tp_size=2, context_length=CTX).resolve()
        r = ModelRunner(ModelConfig(ckpt, "float32", context_length=CTX), sa, group)
        queue.put((rank, r.max_total_num_tokens, r.token_to_kv_pool.size, r.token_to_kv_pool_allocator.size))
    except BaseException as e:  # the parent reports it instead of waiting
        queue.put((rank, repr(e), None, None))


def test_tp_ranks_agree_on_the_least_capacity(ckpt):
    """Every TP rank runs the same scheduling decisions on its own allocator: a rank with more free
    memory must not hold more KV tokens than the others (their admissions would diverge)."""
    import torch.multiprocessing as mp

    from sglang.srt.testing.multi_rank import free_port

    ctx = mp.get_context("fork")  # the worker is this module's function: no re-import in the child
    queue, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=_rank_capacity, args=(rank, port, ckpt, queue)) for rank in range(2)]
    for p in procs:
        p.start()
    got = dict((r[0], r[1:]) for r in (queue.get(timeout=600) for _ in procs))
    for p in procs:
        p.join(timeout=60)
    assert got[0] == got[1] == (4096, 4096, 4096), got


def _rank_plan(rank: int, port: int, ckpt: str, queue) -> None:
    """One of 2 gloo ranks planning a faked GPU: rank 1's card is nearly full (another process on it)."""
    try:
        from sglang.srt.distributed.parallel_state import init_distributed

        torch.set_num_threads(1)
        group = init_distributed(2, rank, f"tcp://127.0.0.1:{port}", "gloo", timeout_s=300)
        sa = ServerArgs(model_path=ckpt, dtype="float32", device="cpu", tp_size=2, context_length=CTX,
                        max_total_tokens=512).resolve()
        r = ModelRunner(ModelConfig(ckpt, "float32", context_length=CTX), sa, group)
        sa.max_total_tokens = None
        free = 20 * GiB if rank == 0 else GiB // 2
        torch.cuda.mem_get_info = lambda *a: (free, 24 * GiB)
        torch.cuda.empty_cache = lambda: None
        memory_profile.profile_step_peak = lambda runner, tokens, ctx: 0
        try:
            queue.put((rank, "plan", r.plan_device_memory(r._bytes_per_token()).kv_tokens))
        except MemoryPlanError as e:
            queue.put((rank, "error", str(e)))
    except BaseException as e:
        queue.put((rank, "crash", repr(e)))


def test_a_rank_that_cannot_fit_fails_every_rank(ckpt):
    """Rank 1 cannot hold the reserve: rank 0 must fail too instead of going on to the profile
    forward's collectives (where it would wait for rank 1 until --dist-timeout)."""
    import torch.multiprocessing as mp

    from sglang.srt.testing.multi_rank import free_port

    ctx = mp.get_context("fork")
    queue, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=_rank_plan, args=(rank, port, ckpt, queue)) for rank in range(2)]
    for p in procs:
        p.start()
    got = {r[0]: r[1:] for r in (queue.get(timeout=600) for _ in procs)}
    for p in procs:
        p.join(timeout=60)
    assert got[1][0] == "error" and "--chunked-prefill-size" in got[1][1], got
    assert got[0][0] == "error" and "another rank" in got[0][1], got


# -- on a GPU (SGLANG_TEST_DEVICE=cuda): the real device numbers (last: the fork tests above run
# before this process initialises CUDA) ------------------------------------
_CUDA = os.environ.get("SGLANG_TEST_DEVICE", "cpu") == "cuda"
_NEEDS_GPU = pytest.mark.skipif(not _CUDA, reason="GPU half of the plan: run with SGLANG_TEST_DEVICE=cuda on a GPU "
                                "(the CPU tests above fake the device's numbers)")


@_NEEDS_GPU
def test_cuda_dummy_bf16_draw_allocates_nothing():
    """The loading regression on the device: a 256 MB bf16 tensor is filled in place (the old
    init's float32 draw + cast took 3x its size)."""
    from sglang.srt.model_loader.loader import fill_normal_

    t = torch.empty(8192, 16384, dtype=torch.bfloat16, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    fill_normal_(t, 0.02, torch.Generator(device="cuda").manual_seed(0))
    torch.cuda.synchronize()
    assert torch.cuda.max_memory_allocated() - before < 2**20
    assert 0.018 < t[:64].float().std().item() < 0.022


@_NEEDS_GPU
def test_cuda_plan_leaves_the_reserve_free_and_the_largest_step_runs(ckpt):
    """The tiny model on the GPU with the whole card to plan: the profile forward measured the
    step, the weights are what loading allocated, after start-up (KV pool and CUDA graphs built)
    the device still holds the activations' reserve, and a prefill of the largest step runs."""
    sa = ServerArgs(model_path=ckpt, dtype="bfloat16", device="cuda", context_length=CTX,
                    chunked_prefill_size=128).resolve()
    mc = ModelConfig(ckpt, "bfloat16", context_length=CTX)
    r = ModelRunner(mc, sa)
    plan = r.memory_plan
    assert plan is not None and plan.step_tokens == 128 and r.profiled_activation_bytes > 0
    assert plan.weights >= model_weight_bytes(mc)  # + the absorbed-MLA copies post_load_weights makes
    torch.cuda.synchronize()
    free, _ = torch.cuda.mem_get_info()
    assert free + torch.cuda.memory_reserved() - torch.cuda.memory_allocated() >= plan.activations
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, mc.vocab_size, (CTX,), generator=g).tolist() for _ in range(2)]
    logits = prefill_all_logits(r, prompts)
    assert all(torch.isfinite(x).all() for x in logits)
