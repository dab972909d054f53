"""weight_utils: safetensors discovery/iteration, FP8 block (de)quantisation, error reporting (CPU)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest


import torch
from safetensors.torch import save_file

from sglang.srt.model_loader.weight_utils import (
    FP8_E4M3_MAX,
    block_dequant_fp8,
    check_weights_complete,
    dequantize_fp8_weights,
    find_weight_files,
    iter_safetensors_weights,
    quantize_fp8_block,
    read_quant_config,
)

FP8 = torch.float8_e4m3fn
RAGGED_SHAPES = [(128, 128), (300, 200), (1, 129), (129, 1), (5, 7), (257, 384)]


def _ref_dequant(q: torch.Tensor, s: torch.Tensor, bn: int, bk: int) -> torch.Tensor:
    """Independent reference: expand the scale grid with repeat_interleave and crop."""
    n, k = q.shape
    full = s.float().repeat_interleave(bn, 0).repeat_interleave(bk, 1)[:n, :k]
    return q.float() * full


def _blocks(x: torch.Tensor, bn: int, bk: int):
    n, k = x.shape
    for i in range(0, n, bn):
        for j in range(0, k, bk):
            yield (i // bn, j // bk), x[i : i + bn, j : j + bk]


def _assert_fp8_error_bound(w: torch.Tensor, d: torch.Tensor, s: torch.Tensor, bn: int, bk: int):
    """Error bound of round-to-nearest e4m3 on the scaled value y = x / s (|y| <= 448).

    e4m3 has 3 mantissa bits, so for normal |y| >= 2^-6 the error is <= half an ulp <= |y|/16;
    subnormals have a fixed step of 2^-9, i.e. error <= 2^-10. Hence per element
    |x - x_hat| <= max(|x|/16, s * 2^-10). Per block the worst case is the top binade
    [256, 448] whose half-ulp is 16, so max|err| <= 16 * s = amax/28. A small slack covers the
    fp32 rounding of x / s and q * s.
    """
    w, d = w.float(), d.float()
    err = (w - d).abs()
    scale_full = s.repeat_interleave(bn, 0).repeat_interleave(bk, 1)[: w.shape[0], : w.shape[1]]
    elem_bound = torch.maximum(w.abs() / 16, scale_full * 2.0**-10)
    assert torch.all(err <= elem_bound * (1 + 1e-5) + 1e-30), float((err - elem_bound).max())
    for (bi, bj), blk in _blocks(w, bn, bk):
        amax = blk.abs().max()
        blk_err = err[bi * bn : bi * bn + bn, bj * bk : bj * bk + bk]
        assert blk_err.max() <= amax / 28 * (1 + 1e-5)
        if amax > 0:  # the commonly quoted "relative error per block < 1/16", in norm form
            assert blk_err.norm() / blk.norm() < 1 / 16


# --------------------------------------------------------------------------------------------
# quantise / dequantise
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", RAGGED_SHAPES)
@pytest.mark.parametrize("block", [(128, 128), (64, 32)])
def test_round_trip_error_bound(shape, block):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(shape, generator=g)
    # Very different magnitudes per row band, so per-block scales actually matter.
    w = w * torch.logspace(-4, 2, shape[0]).unsqueeze(1)
    q, s = quantize_fp8_block(w, block)
    bn, bk = block
    assert q.dtype == FP8 and q.shape == w.shape
    assert s.dtype == torch.float32 and s.shape == (math.ceil(shape[0] / bn), math.ceil(shape[1] / bk))
    # Each block's largest element maps onto the e4m3 max.
    for (bi, bj), blk in _blocks(w, bn, bk):
        torch.testing.assert_close(s[bi, bj], blk.abs().max() / FP8_E4M3_MAX)
    assert q.float().abs().max() <= FP8_E4M3_MAX
    d = block_dequant_fp8(q, s, block, torch.float32)
    assert d.shape == w.shape and d.dtype == torch.float32
    _assert_fp8_error_bound(w, d, s, bn, bk)


@pytest.mark.parametrize("shape", RAGGED_SHAPES)
def test_dequant_matches_reference_and_casts(shape):
    g = torch.Generator().manual_seed(1)
    q = (torch.randn(shape, generator=g) * 100).clamp(-448, 448).to(FP8)
    s = torch.rand(math.ceil(shape[0] / 128), math.ceil(shape[1] / 128), generator=g) + 0.01
    ref = _ref_dequant(q, s, 128, 128)
    torch.testing.assert_close(block_dequant_fp8(q, s, (128, 128), torch.float32), ref, rtol=0, atol=0)
    out = block_dequant_fp8(q, s, (128, 128), torch.bfloat16)
    assert out.dtype == torch.bfloat16 and out.is_contiguous()
    torch.testing.assert_close(out, ref.to(torch.bfloat16), rtol=0, atol=0)


def test_zero_block_and_exact_values():
    w = torch.zeros(200, 130)
    w[:128, :128] = 2.0  # exactly representable after scaling -> exact round trip
    q, s = quantize_fp8_block(w)
    assert torch.isfinite(s).all() and (s > 0).all()
    assert s[1, 1] == 1.0  # all-zero block guard
    d = block_dequant_fp8(q, s, (128, 128), torch.float32)
    assert torch.isfinite(d).all()
    torch.testing.assert_close(d, w, rtol=0, atol=0)


def test_bf16_input_quantises():
    w = torch.randn(130, 140, dtype=torch.bfloat16)
    q, s = quantize_fp8_block(w)
    _assert_fp8_error_bound(w, block_dequant_fp8(q, s, (128, 128), torch.float32), s, 128, 128)


def test_dequant_rejects_mismatched_scale_shape():
    q, s = quantize_fp8_block(torch.randn(300, 200))
    with pytest.raises(ValueError, match=r"expected \(5, 4\).*weight_block_size"):
        block_dequant_fp8(q, s, (64, 64), torch.float32)


# --------------------------------------------------------------------------------------------
# dequantize_fp8_weights stream
# --------------------------------------------------------------------------------------------


def _quant_pair(name: str, shape, seed: int):
    w = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
    q, s = quantize_fp8_block(w)
    return w, (name, q), (name + "_scale_inv", s)


def test_stream_either_order_and_passthrough():
    wa, qa, sa = _quant_pair("a.weight", (300, 200), 0)
    wb, qb, sb = _quant_pair("b.weight", (129, 257), 1)
    norm = torch.ones(7, dtype=torch.float32)  # stays float32 even though dtype=bf16 requested
    stream = [qa, ("norm.weight", norm), sb, sa, qb]  # a: weight first; b: scale first
    out = list(dequantize_fp8_weights(stream, torch.bfloat16))
    names = [n for n, _ in out]
    assert names == ["norm.weight", "a.weight", "b.weight"]
    got = dict(out)
    assert got["norm.weight"] is norm
    assert got["a.weight"].dtype == torch.bfloat16 and got["a.weight"].shape == (300, 200)
    torch.testing.assert_close(got["a.weight"], block_dequant_fp8(qa[1], sa[1], (128, 128), torch.bfloat16))
    torch.testing.assert_close(got["b.weight"], block_dequant_fp8(qb[1], sb[1], (128, 128), torch.bfloat16))


def test_stream_is_lazy_for_adjacent_pairs():
    """Adjacent pairs are emitted as soon as both halves are read: nothing else is buffered."""
    items = []
    for i in range(4):
        _, q, s = _quant_pair(f"l{i}.weight", (64, 64), i)
        items += [q, s]
    consumed = 0

    def source():
        nonlocal consumed
        for it in items:
            consumed += 1
            yield it

    gen = dequantize_fp8_weights(source(), torch.float32)
    for i in range(4):
        name, _ = next(gen)
        assert name == f"l{i}.weight" and consumed == 2 * (i + 1)
    assert list(gen) == []


def test_missing_scale_reported_at_end():
    _, qa, sa = _quant_pair("a.weight", (64, 64), 0)
    _, qb, _ = _quant_pair("layers.1.mlp.down_proj.weight", (64, 64), 1)
    gen = dequantize_fp8_weights([qb, qa, sa, ("x.bias", torch.zeros(3))], torch.float32)
    with pytest.raises(ValueError, match=r"1 FP8 weight\(s\) without .*layers\.1\.mlp\.down_proj\.weight"):
        list(gen)


def test_orphan_scale_reported_at_end():
    _, qa, sa = _quant_pair("a.weight", (64, 64), 0)
    _, _, sb = _quant_pair("b.weight", (64, 64), 1)
    with pytest.raises(ValueError, match=r"1 scale\(s\) without an FP8 weight: b\.weight_scale_inv") as ei:
        list(dequantize_fp8_weights([sb, qa, sa], torch.float32))
    assert "a.weight" not in str(ei.value)


def test_scale_for_non_fp8_weight():
    _, _, sa = _quant_pair("a.weight", (64, 64), 0)
    for stream in ([sa, ("a.weight", torch.zeros(64, 64))], [("a.weight", torch.zeros(64, 64)), sa]):
        with pytest.raises(ValueError, match="not an FP8 tensor"):
            list(dequantize_fp8_weights(stream, torch.float32))


def test_input_scale_rejected():
    _, qa, sa = _quant_pair("a.weight", (64, 64), 0)
    stream = [qa, sa, ("a.input_scale", torch.tensor(0.5))]
    with pytest.raises(ValueError, match=r"'a\.input_scale'.*static activation quanti[sz]ation is not supported"):
        list(dequantize_fp8_weights(stream, torch.float32))


def test_per_tensor_weight_scale_hint():
    q = torch.zeros(64, 64).to(FP8)
    stream = [("a.weight", q), ("a.weight_scale", torch.tensor(1.0))]
    with pytest.raises(ValueError, match=r"a\.weight.*per-tensor '\*\.weight_scale'"):
        list(dequantize_fp8_weights(stream, torch.float32))


# --------------------------------------------------------------------------------------------
# Files and sharded checkpoints
# --------------------------------------------------------------------------------------------


def _touch_st(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    save_file(tensors, str(path))


def test_sharded_fp8_checkpoint_scale_in_other_shard(tmp_path, capsys):
    wa, (_, qa), (_, sa) = _quant_pair("model.layers.0.self_attn.o_proj.weight", (300, 200), 0)
    wb, (_, qb), (_, sb) = _quant_pair("model.layers.0.mlp.gate_proj.weight", (129, 257), 1)
    norm = torch.randn(200, dtype=torch.bfloat16)
    shards = {
        "model-00001-of-00002.safetensors": {
            "model.layers.0.self_attn.o_proj.weight": qa,
            "model.layers.0.mlp.gate_proj.weight_scale_inv": sb,  # scale before its weight
            "model.norm.weight": norm,
        },
        "model-00002-of-00002.safetensors": {
            "model.layers.0.self_attn.o_proj.weight_scale_inv": sa,  # scale after, other shard
            "model.layers.0.mlp.gate_proj.weight": qb,
        },
    }
    weight_map = {}
    for fname, tensors in shards.items():
        _touch_st(tmp_path / fname, tensors)
        weight_map.update(dict.fromkeys(tensors, fname))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    # A stray file outside the index must be ignored.
    _touch_st(tmp_path / "consolidated.safetensors", {"junk": torch.zeros(1)})
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["DeepseekV3ForCausalLM"],
        "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                "weight_block_size": [128, 128]},
    }))

    assert [Path(p).name for p in find_weight_files(str(tmp_path))] == list(shards)
    raw = list(iter_safetensors_weights(str(tmp_path)))
    assert sorted(n for n, _ in raw) == sorted(weight_map)
    assert all(t.device.type == "cpu" for _, t in raw)
    assert "junk" not in dict(raw)

    quant = read_quant_config(str(tmp_path))
    out = dict(dequantize_fp8_weights(iter_safetensors_weights(str(tmp_path)), torch.float32,
                                      tuple(quant["weight_block_size"])))
    assert set(out) == {"model.layers.0.self_attn.o_proj.weight", "model.layers.0.mlp.gate_proj.weight",
                        "model.norm.weight"}
    assert not any(n.endswith("_scale_inv") for n in out)
    torch.testing.assert_close(out["model.norm.weight"], norm, rtol=0, atol=0)
    assert out["model.norm.weight"].dtype == torch.bfloat16  # passthrough is not cast
    _assert_fp8_error_bound(wa, out["model.layers.0.self_attn.o_proj.weight"], sa, 128, 128)
    _assert_fp8_error_bound(wb, out["model.layers.0.mlp.gate_proj.weight"], sb, 128, 128)
    assert capsys.readouterr().err == ""  # no progress bar noise when not a TTY


def test_files_order_glob_sorted_and_iteration_follows(tmp_path):
    for i, fname in enumerate(["c.safetensors", "a.safetensors", "b.safetensors"]):
        _touch_st(tmp_path / fname, {f"t_{fname[0]}": torch.full((2,), float(i))})
    files = find_weight_files(str(tmp_path))
    assert [Path(p).name for p in files] == ["a.safetensors", "b.safetensors", "c.safetensors"]
    assert [n for n, _ in iter_safetensors_weights(str(tmp_path))] == ["t_a", "t_b", "t_c"]


def test_files_single_model_safetensors_preferred(tmp_path):
    _touch_st(tmp_path / "model.safetensors", {"x": torch.zeros(1)})
    _touch_st(tmp_path / "aaa.safetensors", {"y": torch.zeros(1)})
    assert [Path(p).name for p in find_weight_files(str(tmp_path))] == ["model.safetensors"]
    assert [n for n, _ in iter_safetensors_weights(str(tmp_path))] == ["x"]


def test_files_index_dedup_sorted_and_missing_shard(tmp_path):
    wm = {"a": "s-2.safetensors", "b": "s-1.safetensors", "c": "s-2.safetensors"}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": wm}))
    _touch_st(tmp_path / "s-1.safetensors", {"b": torch.zeros(1)})
    with pytest.raises(ValueError, match=r"1 shard\(s\) that do not exist: s-2\.safetensors"):
        find_weight_files(str(tmp_path))
    _touch_st(tmp_path / "s-2.safetensors", {"a": torch.zeros(1), "c": torch.zeros(1)})
    assert [Path(p).name for p in find_weight_files(str(tmp_path))] == ["s-1.safetensors", "s-2.safetensors"]


def test_no_safetensors_files(tmp_path):
    with pytest.raises(ValueError, match=r"no \*\.safetensors.*only the safetensors format is supported") as ei:
        find_weight_files(str(tmp_path))
    assert str(tmp_path) in str(ei.value)
    torch.save({"w": torch.zeros(1)}, tmp_path / "pytorch_model.bin")
    (tmp_path / "extra.pt").write_bytes(b"")
    with pytest.raises(ValueError, match=r"only the safetensors.*extra\.pt, pytorch_model\.bin"):
        find_weight_files(str(tmp_path))
    with pytest.raises(ValueError, match="not a directory"):
        find_weight_files(str(tmp_path / "nope"))


# --------------------------------------------------------------------------------------------
# Quant config
# --------------------------------------------------------------------------------------------


def _write_cfg(tmp_path: Path, quant) -> str:
    cfg = {"architectures": ["DeepseekV3ForCausalLM"]}
    if quant is not None:
        cfg["quantization_config"] = quant
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return str(tmp_path)


def test_read_quant_config_supported(tmp_path):
    assert read_quant_config(str(tmp_path)) is None  # no config.json
    assert read_quant_config(_write_cfg(tmp_path, None)) is None
    q = read_quant_config(_write_cfg(tmp_path, {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                                "weight_block_size": [64, 32]}))
    assert q["quant_method"] == "fp8" and q["weight_block_size"] == [64, 32]
    # HF transformers' FP8 config omits fmt and may omit the block size.
    q = read_quant_config(_write_cfg(tmp_path, {"quant_method": "fp8"}))
    assert q["fmt"] == "e4m3" and q["weight_block_size"] == [128, 128]


@pytest.mark.parametrize(
    "quant, pattern",
    [
        ({"quant_method": "gptq", "bits": 4}, r"unsupported quantization method 'gptq'.*supported: quant_method 'fp8'"),
        ({"quant_method": "compressed-tensors"}, r"'compressed-tensors'.*supported: quant_method 'fp8'"),
        ({"bits": 4}, r"unsupported quantization method None"),
        ({"quant_method": "fp8", "fmt": "e5m2"}, r"unsupported fp8 fmt 'e5m2'"),
        ({"quant_method": "fp8", "activation_scheme": "static"}, r"static activation quanti[sz]ation is not supported"),
        ({"quant_method": "fp8", "weight_block_size": [128]}, r"unsupported weight_block_size \[128\]"),
        ({"quant_method": "fp8", "weight_block_size": None}, r"unsupported weight_block_size None"),
    ],
)
def test_read_quant_config_unsupported(tmp_path, quant, pattern):
    with pytest.raises(ValueError, match=pattern):
        read_quant_config(_write_cfg(tmp_path, quant))


# --------------------------------------------------------------------------------------------
# check_weights_complete
# --------------------------------------------------------------------------------------------


def test_check_weights_complete_ok():
    check_weights_complete({"a", "b"}, {"a", "b"}, set())
    check_weights_complete(set(), set(), set())


def test_check_weights_complete_message():
    expected = {f"model.layers.{i:02d}.w" for i in range(50)}
    loaded = {f"model.layers.{i:02d}.w" for i in range(5)}
    unexpected = {"lm_head.bias", "model.extra"}
    with pytest.raises(ValueError) as ei:
        check_weights_complete(expected, loaded, unexpected)
    msg = str(ei.value)
    assert "45 missing weight(s) (of 50 expected)" in msg
    assert "model.layers.05.w" in msg and "model.layers.24.w" in msg  # first 20, sorted
    assert "model.layers.25.w" not in msg and "(25 more)" in msg
    assert "model.layers.00.w" not in msg  # loaded ones are not listed
    assert "2 unexpected checkpoint weight(s): lm_head.bias, model.extra" in msg


def test_check_weights_complete_one_side_only():
    with pytest.raises(ValueError, match=r"^checkpoint does not match the model: 1 unexpected.*: x$"):
        check_weights_complete({"a"}, {"a"}, {"x"})
    with pytest.raises(ValueError, match=r"1 missing weight\(s\) \(of 2 expected\): b$"):
        check_weights_complete({"a", "b"}, {"a"}, set())
