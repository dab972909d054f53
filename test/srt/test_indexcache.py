"""IndexCache top-k sharing end to end: transformers' GlmMoeDsaForCausalLM (which implements the
same "full"/"shared" schedule) is the oracle on the same tiny weights."""

import subprocess
import sys

import os

import pytest
import torch

from sglang.srt.entrypoints.engine import Engine
from sglang.srt.debug.checks import StaleTopkError, assert_topk_matches_batch
from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode
from sglang.srt.testing.runner_utils import prefill_all_logits
from sglang.srt.testing.reference import hf_greedy_generate, hf_prefill_logits, load_hf_reference
from sglang.srt.model_loader.tiny_models import make_tiny_checkpoint

LOGIT_ATOL = 1e-4
LAYERS = 8
NEW_TOKENS = 24


def _prompts():
    g = torch.Generator().manual_seed(7)
    return [torch.randint(5, 1000, (n,), generator=g).tolist() for n in (6, 45, 90)]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    cache = {}

    def make(**overrides):
        key = tuple(sorted(overrides.items()))
        if key not in cache:
            d = tmp_path_factory.mktemp("ic")
            cache[key] = make_tiny_checkpoint(str(d), arch="glm_moe_dsa", num_hidden_layers=LAYERS, **overrides)
        return cache[key]

    return make


# SGLANG_TEST_DEVICE=cuda runs our side on a GPU (the reference stays on CPU in fp32).
DEVICE = os.environ.get("SGLANG_TEST_DEVICE", "cpu")


def _engine(path, **kw):
    return Engine(model_path=path, dtype="float32", device=DEVICE, max_total_tokens=4096,
                  nsa_index_k_dtype="float32", random_seed=0, **kw)


def _logits(engine, prompts):
    return prefill_all_logits(engine.scheduler.tp_worker.model_runner, prompts)


def _check_against_reference(engine, hf):
    prompts = _prompts()
    for p, ours in zip(prompts, _logits(engine, prompts)):
        assert (ours - hf_prefill_logits(hf, p)).abs().max().item() < LOGIT_ATOL
    outs = engine.generate(input_ids=prompts, sampling_params={"temperature": 0, "max_new_tokens": NEW_TOKENS,
                                                              "ignore_eos": True})
    for p, o in zip(prompts, outs):
        assert o["output_ids"] == hf_greedy_generate(hf, p, NEW_TOKENS)


@pytest.mark.parametrize("freq,offset", [(4, 2), (4, 3), (2, 2)])
def test_shared_schedule_matches_transformers(ckpt, freq, offset):
    path = ckpt(index_topk_freq=freq, index_skip_topk_offset=offset)
    hf = load_hf_reference(path)
    engine = _engine(path)
    sched = engine.model_config.index_layer_schedule
    assert sched.indexer_types() == hf.config.indexer_types and sched.shares
    layers = engine.scheduler.tp_worker.model_runner.model.model.layers
    assert [l.self_attn.indexer is not None for l in layers] == list(sched.full)
    _check_against_reference(engine, hf)


def test_pattern_matches_transformers(ckpt):
    path = ckpt(index_topk_pattern="FSFSSFSS")
    _check_against_reference(_engine(path), load_hf_reference(path))


def test_flag_on_a_full_checkpoint_matches_transformers(ckpt, monkeypatch):
    """A checkpoint with indexer weights on every layer, shared via the server flag: the unused
    indexer weights are ignored; the reference gets the same indexer_types."""
    from sglang.srt.debug import checks as debug_checks

    monkeypatch.setattr(debug_checks, "DEBUG_CHECKS", True)  # shared layers validate inherited top-k
    path = ckpt()
    engine = _engine(path, nsa_index_topk_freq=4, nsa_index_topk_offset=3)
    types = engine.model_config.index_layer_schedule.indexer_types()
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager",
                                              indexer_types=types, use_kernels=False).eval()
    assert hf.config.indexer_types == types
    _check_against_reference(engine, hf)


def test_freq_one_is_bit_identical_to_no_feature(ckpt):
    base = _engine(ckpt())
    for eng in (_engine(ckpt(index_topk_freq=1, index_skip_topk_offset=3)), _engine(ckpt(), nsa_index_topk_freq=1)):
        assert not eng.model_config.index_layer_schedule.shares
        a, b = base.scheduler.tp_worker.model_runner.token_to_kv_pool, eng.scheduler.tp_worker.model_runner.token_to_kv_pool
        assert a.index_layer_ids == b.index_layer_ids == list(range(LAYERS))
        assert [t.shape for t in a.index_k_with_scale_buffer] == [t.shape for t in b.index_k_with_scale_buffer]
        for x, y in zip(_logits(base, _prompts()), _logits(eng, _prompts())):
            assert torch.equal(x, y)
        sp = {"temperature": 0, "max_new_tokens": 16, "ignore_eos": True}
        assert [o["output_ids"] for o in base.generate(input_ids=_prompts(), sampling_params=sp)] == \
               [o["output_ids"] for o in eng.generate(input_ids=_prompts(), sampling_params=sp)]


def test_pool_has_index_buffers_only_for_full_layers_and_capacity_rises(ckpt):
    full = Engine(model_path=ckpt(), dtype="float32", device="cpu", random_seed=0)  # memory-budget sizing
    shared = Engine(model_path=ckpt(index_topk_freq=4, index_skip_topk_offset=2), dtype="float32", device="cpu",
                    random_seed=0)
    pf, ps = full.scheduler.tp_worker.model_runner.token_to_kv_pool, shared.scheduler.tp_worker.model_runner.token_to_kv_pool
    sched = shared.model_config.index_layer_schedule
    assert ps.index_layer_ids == sched.full_layer_ids and len(ps.index_k_with_scale_buffer) == len(sched.full_layer_ids)
    for lid in range(LAYERS):
        if sched.full[lid]:
            ps.index_buffer_id(lid)
        else:
            with pytest.raises(KeyError, match="shared IndexCache layer"):
                ps.index_buffer_id(lid)
    # bytes/token: MLA latent + rope for every layer, index K (+ scales) for full layers only
    mla = (64 + 16) * 4
    assert ps.kv_bytes_per_token() == LAYERS * mla + len(sched.full_layer_ids) * ps.index_bytes_per_token
    assert pf.kv_bytes_per_token() == LAYERS * (mla + pf.index_bytes_per_token)
    cf, cs = full.scheduler.max_total_num_tokens, shared.scheduler.max_total_num_tokens
    assert cs > cf and abs(cs / cf - pf.kv_bytes_per_token() / ps.kv_bytes_per_token()) < 1e-3


def test_stale_topk_is_caught():
    fb = ForwardBatch.build(ForwardMode.EXTEND, [1, 2, 3], [0], [0], [3], torch.tensor([5, 6, 7]))
    ok = torch.tensor([[0, -1], [0, 1], [2, 0]], dtype=torch.int32)
    assert_topk_matches_batch(ok, fb, 3)
    with pytest.raises(StaleTopkError, match="shape"):
        assert_topk_matches_batch(ok[:2], fb, 3)
    with pytest.raises(StaleTopkError, match="non-causal"):
        assert_topk_matches_batch(torch.tensor([[0, 1], [0, 1], [2, 0]], dtype=torch.int32), fb, 3)


def test_debug_checks_hook_checks_inherited_topk_in_the_model(ckpt, monkeypatch):
    """SGLANG_DEBUG_CHECKS installs its check as a forward hook (debug/hooks.py) on every layer that
    reuses a given top-k: a shared layer handed indices of another batch fails in the model's own
    forward; full layers (which score their own) are not checked; off, nothing is installed."""
    from sglang.srt.debug import checks as debug_checks

    path = ckpt(index_topk_freq=4, index_skip_topk_offset=3)
    ids = [5, 6, 7, 8]
    for on in (True, False):
        monkeypatch.setattr(debug_checks, "DEBUG_CHECKS", on)
        engine = _engine(path)
        mr = engine.scheduler.tp_worker.model_runner
        layers = mr.model.model.layers
        assert sum(bool(l.self_attn._forward_pre_hooks) for l in layers) == (LAYERS if on else 0)
        slot = mr.req_to_token_pool.alloc(1)[0]
        locs = mr.token_to_kv_pool_allocator.alloc_extend([0], [len(ids)], [-1])
        mr.req_to_token_pool.write(slot, 0, locs)
        fb = ForwardBatch.build(ForwardMode.EXTEND, ids, [slot], [0], [len(ids)], locs, device=mr.device)
        fb.req_to_token_pool, fb.token_to_kv_pool, fb.attn_backend = mr.req_to_token_pool, mr.token_to_kv_pool, \
            mr.attn_backend
        mr.attn_backend.init_forward_metadata(fb)
        shared = next(l for l in layers if l.self_attn.skip_topk)
        hidden = torch.randn(len(ids), engine.model_config.hf_config.hidden_size)
        stale = torch.zeros(len(ids) - 1, 2, dtype=torch.int32)  # rows of another batch
        if on:
            with pytest.raises(StaleTopkError, match="shape"):
                shared.self_attn(fb.positions, hidden, fb, stale)
        else:
            shared.self_attn(fb.positions, hidden, fb, torch.zeros(len(ids), 2, dtype=torch.int32))


def _launch(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "sglang.launch_server", *args], capture_output=True, text=True,
                          timeout=120)


@pytest.mark.parametrize("args,needle", [
    (["--nsa-index-topk-freq", "4", "--enable-two-batch-overlap"], "does not carry top-k"),
    (["--nsa-index-topk-pattern", "FSFS", "--enable-two-batch-overlap"], "does not carry top-k"),
    (["--nsa-index-topk-pattern", "FSXS"], "--nsa-index-topk-pattern"),
    (["--nsa-index-topk-pattern", "FSF"], "--nsa-index-topk-pattern: has 3 entries for 4 layers"),
    (["--nsa-index-topk-pattern", "SFFF"], "layer 0 must be full"),
    (["--nsa-index-topk-freq", "2", "--nsa-index-topk-offset", "0"], "--nsa-index-topk-offset"),
    (["--nsa-index-topk-freq", "2", "--nsa-index-topk-pattern", "FSFS"], "conflicts"),
    (["--nsa-index-topk-freq", "2", "--json-model-override-args", '{"index_topk_freq": 4}'], "conflicts"),
    (["--json-model-override-args", '{"index_topk_freq": 2, "index_skip_topk_offset": 0}'], "offset"),
])
def test_startup_errors(args, needle):
    r = _launch("--model-path", "builtin:tiny-glm-moe-dsa", *args)
    assert r.returncode != 0 and needle in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


def test_tbo_without_sharing_is_refused_plainly():
    r = _launch("--model-path", "builtin:tiny-glm-moe-dsa", "--enable-two-batch-overlap")
    assert r.returncode != 0 and "--enable-two-batch-overlap" in r.stderr and "not implemented" in r.stderr


def test_json_override_equals_flags(ckpt):
    """--json-model-override-args sets the same schedule the flags do, with the same outputs."""
    by_flags = _engine(ckpt(), nsa_index_topk_freq=4, nsa_index_topk_offset=3)
    by_json = _engine(ckpt(), json_model_override_args='{"index_topk_freq": 4, "index_skip_topk_offset": 3}')
    assert by_json.model_config.index_layer_schedule.full == by_flags.model_config.index_layer_schedule.full
    assert by_json.model_config.index_layer_schedule.shares
    sp = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}
    assert [o["output_ids"] for o in by_json.generate(input_ids=_prompts(), sampling_params=sp)] == \
           [o["output_ids"] for o in by_flags.generate(input_ids=_prompts(), sampling_params=sp)]
