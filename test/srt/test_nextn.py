"""The NextN / MTP draft layer: loads model.layers.{N}.* of a checkpoint, always owns a DSA
indexer (runs it when no previous top-k is given), and matches transformers' decoder layer run
on the same MTP weights (transformers itself ignores MTP weights, so the reference is built from
its one-layer model with the MTP layer's tensors)."""

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from sglang.srt.configs.model_config import ModelConfig
from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode, SpecInput
from sglang.srt.model_executor.model_runner import ModelRunner
from sglang.srt.server_args import ServerArgs
from sglang.srt.testing.reference import load_hf_reference
from sglang.srt.model_loader.tiny_models import make_tiny_checkpoint

LAYERS = 4


def _add_mtp_layer(path: str, with_head: bool) -> dict[str, torch.Tensor]:
    """Append a random MTP layer (a copy of layer 1's shapes) as model.layers.{LAYERS}.*."""
    g = torch.Generator().manual_seed(11)
    f = os.path.join(path, "model.safetensors")
    tensors = load_file(f)
    mtp = {}
    for name, t in tensors.items():
        if name.startswith("model.layers.1."):
            new = name.replace("model.layers.1.", f"model.layers.{LAYERS}.", 1)
            noise = torch.randn(t.shape, generator=g) * 0.02 if t.dtype.is_floating_point else 0
            mtp[new] = (t + noise).contiguous()
    h = tensors["model.norm.weight"].shape[0]
    p = f"model.layers.{LAYERS}."
    mtp[p + "enorm.weight"] = 1 + 0.1 * torch.randn(h, generator=g)
    mtp[p + "hnorm.weight"] = 1 + 0.1 * torch.randn(h, generator=g)
    mtp[p + "eh_proj.weight"] = 0.05 * torch.randn(h, 2 * h, generator=g)
    mtp[p + "shared_head.norm.weight"] = 1 + 0.1 * torch.randn(h, generator=g)
    if with_head:
        mtp[p + "shared_head.head.weight"] = 0.05 * torch.randn(tensors["lm_head.weight"].shape, generator=g)
        mtp[p + "embed_tokens.weight"] = 0.05 * torch.randn(tensors["model.embed_tokens.weight"].shape, generator=g)
    tensors.update(mtp)
    save_file(tensors, f, metadata={"format": "pt"})
    return tensors


def _reference(path: str, tmp, tensors: dict, ids: list[int], target_hidden: torch.Tensor) -> torch.Tensor:
    """transformers' one-layer model carrying the MTP decoder layer, fed eh_proj(...) as embeddings."""
    p = f"model.layers.{LAYERS}."
    ref_dir = tmp / "mtp_ref"
    ref_dir.mkdir()
    cfg = json.load(open(os.path.join(path, "config.json")))
    cfg.update(num_hidden_layers=1, first_k_dense_replace=0, mlp_layer_types=["sparse"], layer_types=None)
    for k in ("indexer_types", "index_topk_freq", "index_skip_topk_offset", "index_topk_pattern"):
        cfg.pop(k, None)
    json.dump(cfg, open(ref_dir / "config.json", "w"))
    head = tensors.get(p + "shared_head.head.weight", tensors["lm_head.weight"])
    embed = tensors.get(p + "embed_tokens.weight", tensors["model.embed_tokens.weight"])
    ref = {n.replace(p, "model.layers.0.", 1): t for n, t in tensors.items()
           if n.startswith(p) and n.split(".")[3] not in ("enorm", "hnorm", "eh_proj", "shared_head", "embed_tokens")}
    ref.update({"model.norm.weight": tensors[p + "shared_head.norm.weight"], "lm_head.weight": head,
                "model.embed_tokens.weight": embed})
    save_file(ref, str(ref_dir / "model.safetensors"), metadata={"format": "pt"})
    hf = load_hf_reference(str(ref_dir))

    def rms(x, w, eps=cfg["rms_norm_eps"]):
        return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))

    e = rms(embed[torch.tensor(ids)], tensors[p + "enorm.weight"])
    hh = rms(target_hidden, tensors[p + "hnorm.weight"])
    x = torch.cat([e, hh], -1) @ tensors[p + "eh_proj.weight"].T
    with torch.no_grad():
        return hf(inputs_embeds=x[None]).logits[0]


@pytest.mark.parametrize("arch", ["glm_moe_dsa", "deepseek_v32", "deepseek_v3"])
@pytest.mark.parametrize("with_head", [True, False])
def test_nextn_layer_matches_reference(arch, with_head, tmp_path):
    path = make_tiny_checkpoint(str(tmp_path / "ckpt"), arch=arch, num_hidden_layers=LAYERS,
                                **({"index_topk_freq": 2} if arch == "glm_moe_dsa" else {}))
    tensors = _add_mtp_layer(path, with_head)
    sa = ServerArgs(model_path=path, dtype="float32", device="cpu", max_total_tokens=1024,
                    nsa_index_k_dtype="float32").resolve()
    mc = ModelConfig(path, "float32", is_draft_model=True)
    assert mc.architecture.endswith("NextN") and mc.num_kv_layers == 1
    runner = ModelRunner(mc, sa)
    attn = runner.model.model.decoder.self_attn
    if arch != "deepseek_v3":
        # the draft layer owns an indexer even when IndexCache shares target layers
        assert attn.indexer is not None and runner.token_to_kv_pool.index_layer_ids == [0]
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(5, 1000, (60,), generator=g).tolist()  # longer than index_topk (32): sparse
    target_hidden = torch.randn(60, 128, generator=g)
    slot = runner.req_to_token_pool.alloc(1)
    loc = runner.token_to_kv_pool_allocator.alloc(60)
    runner.req_to_token_pool.write(slot[0], 0, loc)
    fb = ForwardBatch.build(ForwardMode.EXTEND, ids, slot, [0], [60], loc, return_all_logits=True,
                            spec=SpecInput(target_hidden))
    ours = runner.forward(fb).full_logits
    ref = _reference(path, tmp_path, tensors, ids, target_hidden)
    assert (ours - ref).abs().max().item() < 1e-4


def test_checkpoint_without_mtp_layer_is_a_clear_error(tmp_path):
    path = make_tiny_checkpoint(str(tmp_path / "ckpt"), arch="glm_moe_dsa", num_hidden_layers=LAYERS)
    sa = ServerArgs(model_path=path, dtype="float32", device="cpu", max_total_tokens=1024).resolve()
    with pytest.raises(ValueError, match="no NextN/MTP layer"):
        ModelRunner(ModelConfig(path, "float32", is_draft_model=True), sa)


def test_nextn_gating_reuses_given_topk_only_when_sharing(tmp_path):
    """skip_topk on the NextN layer follows IndexCache: with sharing, a given top-k is reused;
    without, the layer always runs its own indexer."""
    from sglang.srt.configs.index_layers import layer_index_role, resolve_index_layer_schedule

    shared = resolve_index_layer_schedule(4, [("flags", {"index_topk_freq": 2})])
    full = resolve_index_layer_schedule(4, [])
    assert layer_index_role(shared, 0, is_nextn=True).skip_topk
    assert not layer_index_role(full, 0, is_nextn=True).skip_topk
    assert layer_index_role(full, 0, is_nextn=True).has_indexer


def test_draft_runner_shares_request_slots_and_is_planned_with_the_target(tmp_path):
    """Issue 18 item 1: memory is planned once for every runner that holds KV, and a draft runner
    takes the target's ReqToTokenPool + allocator (same slots, its own KV pool of the same size)."""
    from sglang.srt.model_executor.model_runner import kv_bytes_per_token

    path = make_tiny_checkpoint(str(tmp_path / "ckpt"), arch="deepseek_v32", num_hidden_layers=LAYERS)
    _add_mtp_layer(path, with_head=True)
    sa = ServerArgs(model_path=path, dtype="float32", device="cpu", nsa_index_k_dtype="float32").resolve()
    draft_mc = ModelConfig(path, "float32", is_draft_model=True)
    target_mc = ModelConfig(path, "float32")
    draft_bytes = kv_bytes_per_token(draft_mc, sa)
    alone = ModelRunner(target_mc, sa)
    target = ModelRunner(target_mc, sa, extra_kv_bytes_per_token=draft_bytes)
    target_bytes = target.token_to_kv_pool.kv_bytes_per_token()
    # one budget: the target alone gets more tokens than target + draft together
    assert target.max_total_num_tokens < alone.max_total_num_tokens
    budget = alone.max_total_num_tokens * target_bytes
    assert abs(target.max_total_num_tokens * (target_bytes + draft_bytes) - budget) <= (target_bytes + draft_bytes) * 2
    del alone
    draft = ModelRunner(draft_mc, sa, req_to_token_pool=target.req_to_token_pool,
                        token_to_kv_pool_allocator=target.token_to_kv_pool_allocator,
                        max_total_num_tokens=target.max_total_num_tokens)
    assert draft.req_to_token_pool is target.req_to_token_pool
    assert draft.token_to_kv_pool_allocator is target.token_to_kv_pool_allocator
    assert draft.token_to_kv_pool is not target.token_to_kv_pool
    assert draft.token_to_kv_pool.size == target.token_to_kv_pool.size
    assert draft.token_to_kv_pool.kv_bytes_per_token() == draft_bytes
    # a slot the shared allocator hands out is written by the draft in its own pool only
    slot = target.req_to_token_pool.alloc(1)
    loc = target.token_to_kv_pool_allocator.alloc(8)
    target.req_to_token_pool.write(slot[0], 0, loc)
    fb = ForwardBatch.build(ForwardMode.EXTEND, list(range(5, 13)), slot, [0], [8], loc,
                            spec=SpecInput(torch.randn(8, 128)))
    draft.forward(fb)
    assert draft.token_to_kv_pool.kv_buffer[0][loc].abs().sum() > 0
    assert all(target.token_to_kv_pool.kv_buffer[i][loc].abs().sum() == 0 for i in range(LAYERS))
    with pytest.raises(ValueError, match="allocator and max_total_num_tokens"):
        ModelRunner(draft_mc, sa, req_to_token_pool=target.req_to_token_pool)


def test_nextn_model_takes_the_expert_parallel_options(tmp_path):
    """get_model passes ep_group / moe_dispatch to every model class under --ep-size > 1; the draft
    layer takes them too (its MoE is built with them)."""
    from sglang.srt.distributed.parallel_state import SINGLE_GROUP
    from sglang.srt.model_loader.loader import get_model

    path = make_tiny_checkpoint(str(tmp_path / "ckpt"), arch="deepseek_v32", num_hidden_layers=LAYERS, mtp_layer=True)
    model = get_model(ModelConfig(path, "float32", is_draft_model=True), "cpu", SINGLE_GROUP,
                      ep_group=SINGLE_GROUP, moe_dispatch="local")
    assert model.model.decoder.mlp.experts is not None


def _draft_runner(path: str) -> ModelRunner:
    sa = ServerArgs(model_path=path, dtype="float32", device="cpu", max_total_tokens=1024,
                    nsa_index_k_dtype="fp8_e4m3").resolve()
    return ModelRunner(ModelConfig(path, "float32", is_draft_model=True), sa)


def _draft_extend(runner: ModelRunner, ids: list[int], hidden: torch.Tensor, topk=None):
    slot = runner.req_to_token_pool.alloc(1)
    loc = runner.token_to_kv_pool_allocator.alloc(len(ids))
    runner.req_to_token_pool.write(slot[0], 0, loc)
    fb = ForwardBatch.build(ForwardMode.EXTEND, ids, slot, [0], [len(ids)], loc, return_all_logits=True,
                            spec=SpecInput(hidden, topk))
    logits = runner.forward(fb).full_logits
    pool = runner.token_to_kv_pool
    return logits, pool.get_index_k_pages(0, torch.unique(loc // pool.page_size)).clone()


@pytest.mark.parametrize("arch,shares", [("glm_moe_dsa", True), ("deepseek_v32", False)])
def test_draft_reuses_a_handed_topk_only_when_sharing_and_keeps_its_index_k(arch, shares, tmp_path):
    """Both IndexCache branches of the draft layer. Sharing on: given the target's top-k the draft
    does not score (its indexer's forward never runs), attends with exactly that top-k, and still
    stores the same index K bytes it would have stored scoring (its own later decode steps score
    over them). Sharing off: a handed top-k is ignored."""
    extra = {"index_topk_freq": 2} if shares else {}
    path = make_tiny_checkpoint(str(tmp_path / "ckpt"), arch=arch, num_hidden_layers=LAYERS, mtp_layer=True, **extra)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(5, 1000, (70,), generator=g).tolist()  # > index_topk (32): sparse selection
    hidden = torch.randn(70, 128, generator=g)
    own = _draft_runner(path)
    indexer = own.model.model.decoder.self_attn.indexer
    seen = []
    real = indexer.forward
    indexer.forward = lambda *a: seen.append(real(*a)) or seen[-1]
    own_logits, own_index_k = _draft_extend(own, ids, hidden)
    assert len(seen) == 1
    own_topk = seen[0]

    given = _draft_runner(path)
    calls = []
    gi = given.model.model.decoder.self_attn.indexer
    real_given = gi.forward
    gi.forward = lambda *a: calls.append(1) or real_given(*a)
    logits, index_k = _draft_extend(given, ids, hidden, topk=own_topk)
    assert torch.equal(index_k, own_index_k)  # store_k writes what scoring would have written
    assert (logits - own_logits).abs().max().item() < 1e-5
    assert len(calls) == (0 if shares else 1)

    # a different handed top-k (only the 8 latest causal positions) changes the result iff reused
    pos = torch.arange(70)[:, None]
    other = torch.where(torch.arange(32)[None, :] < 8, (pos - torch.arange(32)[None, :]).clamp(min=-1), -1)
    other = torch.where(other >= 0, other, -1).to(torch.int32)
    logits2, index_k2 = _draft_extend(_draft_runner(path), ids, hidden, topk=other)
    assert torch.equal(index_k2, own_index_k)
    diff = (logits2 - own_logits).abs().max().item()
    assert (diff > 1e-3) if shares else (diff < 1e-5)
