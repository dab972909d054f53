"""KVCache.on_layer_end through a real eager model forward: once per decoder layer in order (the
target pool), once for the NextN layer (the draft pool), after the layer's KV is written and
before the next layer's; nothing under suspend_layer_end_hooks() (how CUDA graphs are captured)."""

from __future__ import annotations

import pytest
import torch

from sglang.srt.configs.model_config import ModelConfig
from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode, SpecInput
from sglang.srt.model_executor.model_runner import ModelRunner
from sglang.srt.server_args import ServerArgs
from sglang.srt.testing.runner_utils import prefill_all_logits
from sglang.srt.model_loader.tiny_models import make_tiny_checkpoint


@pytest.fixture(scope="module")
def target_runner(builtin_path):
    path = builtin_path("tiny-glm-moe-dsa-shared")  # 6 layers, IndexCache F F S F S F
    sa = ServerArgs(model_path=path, dtype="float32", device="cpu", max_total_tokens=512).resolve()
    return ModelRunner(ModelConfig(path, "float32"), sa)


def _recorder(pool):
    """A callback recording (layer, its KV written, the next layer's still empty); the buffers
    start zeroed."""
    calls = []

    def cb(layer_id: int) -> None:
        written = bool(pool.kv_buffer[layer_id].ne(0).any())
        nxt_empty = layer_id + 1 == pool.layer_num or bool(pool.kv_buffer[layer_id + 1].eq(0).all())
        calls.append((layer_id, written, nxt_empty))

    return calls, cb


def test_layer_end_once_per_layer_after_its_kv(target_runner):
    pool = target_runner.token_to_kv_pool
    assert pool.layer_num == 6
    calls, cb = _recorder(pool)
    order = []
    pool.register_layer_end_callback(cb)
    pool.register_layer_end_callback(order.append)  # callbacks run in registration order
    try:
        for buf in pool.kv_buffer:
            buf.zero_()
        prefill_all_logits(target_runner, [[5, 6, 7, 8, 9], [11, 12]])
        assert calls == [(i, True, True) for i in range(6)]
        assert order == list(range(6))

        calls.clear()
        order.clear()
        with pool.suspend_layer_end_hooks():  # what the CUDA-graph runner captures under
            prefill_all_logits(target_runner, [[5, 6, 7]])
        assert calls == [] and order == []
        prefill_all_logits(target_runner, [[5, 6, 7]])  # resumes after the block
        assert order == list(range(6))
    finally:
        pool._layer_end_callbacks = ()


def test_nextn_layer_ends_on_the_draft_pool(tmp_path):
    path = make_tiny_checkpoint(str(tmp_path / "ckpt"), arch="glm_moe_dsa", num_hidden_layers=4)
    sa = ServerArgs(model_path=path, dtype="float32", device="cpu", max_total_tokens=256,
                    load_format="dummy").resolve()
    draft = ModelRunner(ModelConfig(path, "float32", is_draft_model=True), sa)
    assert draft.token_to_kv_pool.layer_num == 1
    seen = []
    draft.token_to_kv_pool.register_layer_end_callback(seen.append)
    ids = [5, 6, 7, 8]
    slot = draft.req_to_token_pool.alloc(1)
    loc = draft.token_to_kv_pool_allocator.alloc(len(ids))
    draft.req_to_token_pool.write(slot[0], 0, loc)
    hidden = torch.randn(len(ids), draft.model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    fb = ForwardBatch.build(ForwardMode.EXTEND, ids, slot, [0], [len(ids)], loc, spec=SpecInput(hidden))
    draft.forward(fb)
    assert seen == [0]  # the NextN layer is layer 0 of its own one-layer pool
