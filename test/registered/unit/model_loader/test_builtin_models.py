"""Builtin tiny checkpoints: determinism, HF loadability, tokenizer, builtin: resolution (CPU)."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest


os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from sglang.srt.model_loader import builtin
from sglang.srt.model_loader import tiny_models
from sglang.srt.model_loader.tiny_models import build_tokenizer, make_tiny_checkpoint

ARCH_CLASSES = {
    "deepseek_v32": "DeepseekV32ForCausalLM",
    "glm_moe_dsa": "GlmMoeDsaForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    return {arch: Path(make_tiny_checkpoint(str(root / arch), arch=arch)) for arch in ARCH_CLASSES}


def _config(path: Path) -> dict:
    return json.loads((path / "config.json").read_text())


def _assert_same_checkpoint(a: Path, b: Path) -> None:
    ta, tb = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    assert ta.keys() == tb.keys()
    for key in ta:
        assert ta[key].dtype == tb[key].dtype and torch.equal(ta[key], tb[key]), key
    for name in ("tokenizer.json", "config.json", "model.safetensors"):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name


@pytest.mark.parametrize("arch", list(ARCH_CLASSES))
def test_bit_identical_rebuild(arch: str, checkpoints: dict[str, Path], tmp_path: Path) -> None:
    again = Path(make_tiny_checkpoint(str(tmp_path / "again"), arch=arch, seed=0))
    _assert_same_checkpoint(checkpoints[arch], again)


def test_bit_identical_across_cpu_isa(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    # torch's CPU normal_ differs between the DEFAULT and AVX2 kernels; the
    # generator must not depend on it (this is what "across machines" means here).
    out = tmp_path / "default_isa"
    env = {
        **os.environ,
        "ATEN_CPU_CAPABILITY": "default",
        "PYTHONHASHSEED": "123",
        "PYTHONPATH": os.pathsep.join([str(Path(tiny_models.__file__).parents[3])] + sys.path),
    }
    subprocess.run(
        [sys.executable, "-m", "sglang.srt.model_loader.tiny_models", "--arch", "deepseek_v32", "--out", str(out)],
        check=True,
        env=env,
        capture_output=True,
        timeout=120,
    )
    _assert_same_checkpoint(checkpoints["deepseek_v32"], out)


def test_seed_changes_weights(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    other = Path(make_tiny_checkpoint(str(tmp_path / "s1"), arch="deepseek_v32", seed=1))
    a = load_file(str(checkpoints["deepseek_v32"] / "model.safetensors"))
    b = load_file(str(other / "model.safetensors"))
    assert not torch.equal(a["model.embed_tokens.weight"], b["model.embed_tokens.weight"])


@pytest.mark.parametrize("arch", list(ARCH_CLASSES))
def test_loads_in_transformers_and_runs(arch: str, checkpoints: dict[str, Path]) -> None:
    path = checkpoints[arch]
    model = AutoModelForCausalLM.from_pretrained(str(path), use_kernels=False).eval()
    assert type(model).__name__ == ARCH_CLASSES[arch]
    # 80 tokens > index_topk (32): the sparse top-k selection really drops keys.
    ids = torch.randint(5, 1024, (2, 80), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (2, 80, 1024)
    assert torch.isfinite(logits).all()
    assert logits.std() > 1e-3  # not a degenerate all-zero model


@pytest.mark.parametrize("arch", list(ARCH_CLASSES))
def test_config_json(arch: str, checkpoints: dict[str, Path]) -> None:
    cfg = _config(checkpoints[arch])
    assert cfg["architectures"] == [ARCH_CLASSES[arch]]
    assert cfg["model_type"] == arch
    assert cfg["vocab_size"] == 1024
    assert (cfg["bos_token_id"], cfg["eos_token_id"], cfg["pad_token_id"]) == (0, 1, 1)
    assert cfg["tie_word_embeddings"] is False
    if arch == "deepseek_v3":
        assert not any(k.startswith("index") for k in cfg)
    else:
        assert (cfg["index_topk"], cfg["index_n_heads"], cfg["index_head_dim"]) == (32, 16, 64)
        assert cfg["max_position_embeddings"] > 4 * cfg["index_topk"]
    expected_rope = "default" if arch == "glm_moe_dsa" else "yarn"
    assert cfg["rope_parameters"]["rope_type"] == expected_rope


@pytest.mark.parametrize("arch", list(ARCH_CLASSES))
def test_routing_bias_perturbed_and_fp32(arch: str, checkpoints: dict[str, Path]) -> None:
    tensors = load_file(str(checkpoints[arch] / "model.safetensors"))
    biases = {k: v for k, v in tensors.items() if k.endswith("e_score_correction_bias")}
    assert len(biases) == 3  # layers 1..3 are MoE (first_k_dense_replace=1)
    for key, bias in biases.items():
        assert bias.dtype == torch.float32 and bias.shape == (8,)
        assert 0.005 < bias.std().item() < 0.05, key


def test_bf16_checkpoint(tmp_path: Path) -> None:
    path = Path(make_tiny_checkpoint(str(tmp_path / "bf16"), arch="glm_moe_dsa", dtype="bfloat16"))
    tensors = load_file(str(path / "model.safetensors"))
    assert tensors["model.embed_tokens.weight"].dtype == torch.bfloat16
    assert tensors["model.layers.1.mlp.gate.e_score_correction_bias"].dtype == torch.float32
    assert _config(path)["dtype"] == "bfloat16"


@pytest.mark.parametrize("arch", list(ARCH_CLASSES))
def test_checkpoint_is_small(arch: str, checkpoints: dict[str, Path]) -> None:
    size = sum(f.stat().st_size for f in checkpoints[arch].iterdir())
    assert size < 10 * 2**20, size


def test_glm_indexer_schedule_overrides(tmp_path: Path) -> None:
    path = Path(
        make_tiny_checkpoint(
            str(tmp_path / "glm6"),
            arch="glm_moe_dsa",
            num_hidden_layers=6,
            index_topk_freq=4,
            index_skip_topk_offset=3,
        )
    )
    cfg = _config(path)
    assert cfg["indexer_types"] == ["full", "full", "full", "shared", "shared", "shared"]
    assert (cfg["index_topk_freq"], cfg["index_skip_topk_offset"]) == (4, 3)
    assert cfg["num_hidden_layers"] == 6


def test_glm_indexer_pattern_override() -> None:
    cfg = tiny_models.make_tiny_config("glm_moe_dsa", index_topk_pattern="FSSF")
    assert cfg.indexer_types == ["full", "shared", "shared", "full"]
    assert cfg.to_dict()["index_topk_pattern"] == "FSSF"


def test_override_nested_and_default_untouched() -> None:
    rope = {"rope_type": "default", "rope_theta": 50000.0}
    cfg = tiny_models.make_tiny_config("deepseek_v32", rope_parameters=rope, initializer_range=0.02)
    assert cfg.rope_parameters["rope_theta"] == 50000.0 and cfg.initializer_range == 0.02
    assert tiny_models.DEFAULT_CONFIGS["deepseek_v32"]["rope_parameters"]["rope_type"] == "yarn"


def test_cli_value_parsing() -> None:
    parsed = tiny_models._parse_overrides(
        [
            "num_hidden_layers=6",
            "initializer_range=0.02",
            "index_topk_pattern=FSSF",
            'rope_parameters={"rope_type": "default"}',
        ]
    )
    assert parsed == {
        "num_hidden_layers": 6,
        "initializer_range": 0.02,
        "index_topk_pattern": "FSSF",
        "rope_parameters": {"rope_type": "default"},
    }


# ---------------------------------------------------------------------------
# Tokenizer
# ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer(checkpoints: dict[str, Path]):
    return AutoTokenizer.from_pretrained(str(checkpoints["deepseek_v32"]))


def test_tokenizer_deterministic(tmp_path: Path) -> None:
    build_tokenizer(str(tmp_path / "a"))
    build_tokenizer(str(tmp_path / "b"))
    assert (tmp_path / "a" / "tokenizer.json").read_bytes() == (tmp_path / "b" / "tokenizer.json").read_bytes()


def test_tokenizer_special_tokens(tokenizer) -> None:
    assert len(tokenizer) == 1024
    assert (tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token) == (
        "<|begin_of_text|>",
        "<|end_of_text|>",
        "<|end_of_text|>",
    )
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id) == (0, 1, 1)
    ids = tokenizer.convert_tokens_to_ids(["<|system|>", "<|user|>", "<|assistant|>"])
    assert ids == [2, 3, 4]
    # Documented choice: encode() never adds bos/eos.
    assert tokenizer.encode("hello") == tokenizer.encode("hello", add_special_tokens=False)
    assert 0 not in tokenizer.encode("hello") and 1 not in tokenizer.encode("hello")


@pytest.mark.parametrize(
    "text",
    [
        "Question: Tom has 7 boxes. Answer: 7 * 6 = 42. The answer is 42",
        "héllo wörld — naïve café, Straße, 中文字符, 日本語, русский, العربية",
        "emoji 🤖🚀👍🏽 family 👨‍👩‍👧 flags 🇺🇸",
        "line1\nline2\r\n\ttab  two spaces   three\n\n",
        "def f(x):\n    return {'a': [1, 2.5, -3e4]}  # ok?!",
        "",
        " leading space",
    ],
)
def test_tokenizer_round_trip(tokenizer, text: str) -> None:
    ids = tokenizer.encode(text)
    assert all(0 <= i < 1024 for i in ids)
    assert tokenizer.decode(ids) == text


def test_tokenizer_compresses_english(tokenizer) -> None:
    text = "The answer is 42. Please read the instructions carefully before you begin."
    assert len(tokenizer.encode(text)) < len(text.encode()) / 2


def test_chat_template(tokenizer) -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 6 times 7?"},
    ]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|begin_of_text|><|system|>\nBe brief.<|end_of_text|>\n"
        "<|user|>\nWhat is 6 times 7?<|end_of_text|>\n<|assistant|>\n"
    )
    no_gen = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    assert not no_gen.endswith("<|assistant|>\n")
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert ids[0] == 0 and ids[-2:] == [4, tokenizer.encode("\n")[0]]
    assert tokenizer.decode(ids, skip_special_tokens=True) == "\nBe brief.\n\nWhat is 6 times 7?\n\n"
    multipart = [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    assert tokenizer.apply_chat_template(multipart, tokenize=False) == "<|begin_of_text|><|user|>\nhi<|end_of_text|>\n"


# ---------------------------------------------------------------------------
# builtin: resolution
# ---------------------------------------------------------------------------


@pytest.fixture()
def cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv(builtin.CACHE_ENV, str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_builtin_registry() -> None:
    for name in ("tiny-deepseek-v32", "tiny-glm-moe-dsa", "tiny-deepseek-v3"):
        assert name in builtin.BUILTIN_MODELS
    assert builtin.is_builtin("builtin:tiny-glm-moe-dsa")
    assert not builtin.is_builtin("/models/tiny-glm-moe-dsa")


def test_resolve_builtin_caches(cache_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = builtin.resolve_model_path("builtin:tiny-glm-moe-dsa")
    assert Path(path).parent == cache_dir
    assert Path(path).name.startswith("tiny-glm-moe-dsa-")
    assert _config(Path(path))["architectures"] == ["GlmMoeDsaForCausalLM"]
    assert AutoTokenizer.from_pretrained(path).eos_token_id == 1
    assert not [p for p in cache_dir.iterdir() if ".tmp-" in p.name]  # temp dir cleaned up

    def fail(*args, **kwargs):
        raise AssertionError("second resolve must not rebuild")

    monkeypatch.setattr(tiny_models, "make_tiny_checkpoint", fail)
    assert builtin.resolve_model_path("builtin:tiny-glm-moe-dsa") == path


def test_resolve_builtin_matches_direct_build(cache_dir: Path, checkpoints: dict[str, Path]) -> None:
    path = Path(builtin.resolve_model_path("builtin:tiny-deepseek-v32"))
    _assert_same_checkpoint(checkpoints["deepseek_v32"], path)


def test_resolve_builtin_concurrent(cache_dir: Path) -> None:
    # Two processes racing on an empty cache both end with the same valid dir.
    code = (
        "from sglang.srt.model_loader.builtin import resolve_model_path;"
        "print(resolve_model_path('builtin:tiny-deepseek-v3'))"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(tiny_models.__file__).parents[3])] + sys.path)}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for _ in range(2)
    ]
    outs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err for _, err in outs]
    paths = {out.strip().splitlines()[-1] for out, _ in outs}
    assert len(paths) == 1
    (path,) = paths
    assert _config(Path(path))["architectures"] == ["DeepseekV3ForCausalLM"]
    assert [p.name for p in cache_dir.iterdir() if not p.name.endswith(".lock")] == [Path(path).name]


def test_resolve_builtin_lost_race(cache_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Without a lock (non-POSIX), a concurrent winner's rename makes ours fail: use theirs.
    name = "tiny-deepseek-v3"
    final = cache_dir / builtin.builtin_key(name)

    def winner_finishes_first(out_dir: str, **kwargs) -> str:
        final.mkdir(parents=True)
        (final / builtin._MARKER).write_text("{}")
        Path(out_dir, "config.json").write_text("{}")
        return out_dir

    monkeypatch.setattr(builtin, "_file_lock", lambda path: contextlib.nullcontext())
    monkeypatch.setattr(tiny_models, "make_tiny_checkpoint", winner_finishes_first)
    assert builtin.resolve_model_path(f"builtin:{name}") == str(final)
    assert [p.name for p in cache_dir.iterdir()] == [final.name]  # our temp dir is gone


def test_unknown_builtin_lists_names(cache_dir: Path) -> None:
    with pytest.raises(ValueError) as exc:
        builtin.resolve_model_path("builtin:no-such-model")
    msg = str(exc.value)
    assert "no-such-model" in msg
    for name in builtin.BUILTIN_MODELS:
        assert name in msg


def test_missing_local_path(tmp_path: Path) -> None:
    missing = str(tmp_path / "does-not-exist")
    with pytest.raises(ValueError, match="does not exist") as exc:
        builtin.resolve_model_path(missing)
    assert isinstance(exc.value, FileNotFoundError)
    assert "not supported" in str(exc.value) and "builtin:tiny-deepseek-v32" in str(exc.value)
    with pytest.raises(FileNotFoundError):
        builtin.resolve_model_path("deepseek-ai/DeepSeek-V3.2")


def test_existing_local_path_unchanged(checkpoints: dict[str, Path]) -> None:
    path = str(checkpoints["deepseek_v3"])
    assert builtin.resolve_model_path(path) == path


def test_fp8_builtin_is_in_deepseeks_block_format(tmp_path: Path) -> None:
    """tiny-*-fp8: e4m3 weights + fp32 weight_scale_inv [ceil(N/128), ceil(K/128)] with real per-block
    scales (amax / 448, not all equal), partial blocks where the rows are not a multiple of 128
    (kv_a_proj_with_mqa: 80, like the real 576), the router / weights_proj / eh_proj / embeddings / head
    left unquantised, and each FP8 weight's block max at +-448 (the scale convention)."""
    spec = builtin.BUILTIN_MODELS["tiny-deepseek-v32-fp8-mtp"]
    out = make_tiny_checkpoint(str(tmp_path / "fp8"), arch=spec.arch, dtype=spec.dtype, mtp_layer=True,
                               fp8_block_size=spec.fp8_block_size, **spec.overrides)
    assert _config(Path(out))["quantization_config"] == {"quant_method": "fp8", "fmt": "e4m3",
                                                        "activation_scheme": "dynamic",
                                                        "weight_block_size": [128, 128]}
    t = load_file(str(Path(out) / "model.safetensors"))
    fp8 = [k for k, v in t.items() if v.dtype == torch.float8_e4m3fn]
    assert fp8 and all(k + "_scale_inv" in t for k in fp8)
    for k in fp8:
        w, s = t[k], t[k + "_scale_inv"]
        assert s.dtype == torch.float32 and s.shape == (-(-w.shape[0] // 128), -(-w.shape[1] // 128)), k
        assert w[:128, :128].float().abs().max() == 448, k
    kv_a = t["model.layers.0.self_attn.kv_a_proj_with_mqa.weight"]
    assert kv_a.shape[0] % 128 and kv_a.shape[0] == 80
    scales = torch.cat([t[k + "_scale_inv"].flatten() for k in fp8])
    assert scales.unique().numel() > 0.9 * scales.numel() and bool((scales > 0).all())
    kept = ("model.embed_tokens.weight", "lm_head.weight", "model.layers.1.mlp.gate.weight",
            "model.layers.0.self_attn.indexer.weights_proj.weight", "model.layers.4.eh_proj.weight")
    for k in kept:
        assert t[k].dtype == torch.bfloat16 and k + "_scale_inv" not in t, k
    assert "model.layers.4.mlp.experts.0.gate_proj.weight_scale_inv" in t  # the MTP layer is FP8 too
