"""Tiny, deterministic, locally-built checkpoints: the `builtin:` models (model_loader/builtin.py)
the server runs out of the box, and the tests' checkpoints (no HF hub access).

The checkpoints use transformers' own config classes (``DeepseekV32Config``,
``GlmMoeDsaConfig``, ``DeepseekV3Config``) and ``save_pretrained``, so their
``config.json`` and safetensors layout match what real DeepSeek-V3.2 / GLM-5 /
DeepSeek-V3 checkpoints look like (per-expert weights, fp32 routing bias, ...),
just with a few MB of random weights and a 1024-token byte-level BPE tokenizer.

Determinism: the same ``(arch, seed, dtype, overrides)`` gives bit-identical files
on any machine. torch's CPU ``normal_`` kernel is *not* portable (its AVX2 and
default code paths give different bits), so after ``from_config`` every randomly
initialised tensor is redrawn from a portable generator (numpy PCG64 raw output
and IEEE basic arithmetic only), seeded per tensor name.

CLI::

    python -m sglang.srt.model_loader.tiny_models --arch glm_moe_dsa --out DIR \
        [--seed N] [--dtype bfloat16] [--set num_hidden_layers=6 --set index_topk_freq=2]
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import os
import random
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedConfig, PreTrainedTokenizerFast

# Bump when the checkpoint contents change for reasons not visible in this file's
# text (the builtin cache key also hashes this file's source).
TINY_MODELS_VERSION = 1

ARCHS = ("deepseek_v32", "glm_moe_dsa", "deepseek_v3")
DTYPES = ("float32", "bfloat16", "float16")

# ---------------------------------------------------------------------------
# Tokenizer
# ---------------------------------------------------------------------------

BOS_TOKEN = "<|begin_of_text|>"
EOS_TOKEN = "<|end_of_text|>"
SYSTEM_TOKEN = "<|system|>"
USER_TOKEN = "<|user|>"
ASSISTANT_TOKEN = "<|assistant|>"
# Order fixes the ids: bos=0, eos=pad=1 (also the HF config defaults), roles 2..4.
SPECIAL_TOKENS = (BOS_TOKEN, EOS_TOKEN, SYSTEM_TOKEN, USER_TOKEN, ASSISTANT_TOKEN)
BOS_TOKEN_ID, EOS_TOKEN_ID, PAD_TOKEN_ID = 0, 1, 1
TOKENIZER_VOCAB_SIZE = 1024

# The template adds bos itself; plain ``encode()`` never adds special tokens
# (add_bos_token=False), so ``apply_chat_template(tokenize=True)`` and
# ``encode(apply_chat_template(tokenize=False), add_special_tokens=...)`` agree.
# Each turn ends with eos so that generation stops at eos. Tools are listed in a system turn, tool
# results are a `tool` turn and an assistant's tool calls follow its content (a made-up format:
# tests force real models' formats through scripted outputs).
CHAT_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- if tools -%}"
    "{{- '<|system|>\\n# Tools\\n' -}}"
    "{%- for tool in tools -%}{{- tool | tojson -}}{{- '\\n' -}}{%- endfor -%}"
    "{{- eos_token + '\\n' -}}"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] not in ['system', 'user', 'assistant', 'tool'] -%}"
    "{{- raise_exception('Unsupported role: ' + message['role']) -}}"
    "{%- endif -%}"
    "{{- '<|' + message['role'] + '|>\\n' -}}"
    "{%- if message['content'] is string -%}"
    "{{- message['content'] -}}"
    "{%- elif message['content'] is not none -%}"
    "{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'text' -%}{{- part['text'] -}}{%- endif -%}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{%- for call in message.get('tool_calls') or [] -%}"
    "{%- set args = call['function']['arguments'] -%}"
    "{{- '<tool_call>' + call['function']['name'] + ' ' + (args | tojson if args is mapping else args) + '</tool_call>' -}}"
    "{%- endfor -%}"
    "{{- eos_token + '\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|assistant|>\\n' -}}{%- endif -%}"
)

# Training corpus: varied English prose, GSM8K-style word problems, code, digits,
# punctuation. Embedded (no downloads) and generated without randomness.
_PROSE = """\
The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a single step.
Once upon a time, in a small village by the sea, there lived an old fisherman and his wife. Every morning
he rowed his boat out past the rocks, cast his nets, and waited patiently for the tide to turn.
Machine learning models are trained on large datasets. Language models predict the next token given the
previous tokens. Attention lets every position look at every other position, but sparse attention selects
only the most relevant positions, which makes very long contexts affordable.
The weather today is sunny with a high of 75 degrees and a low of 58 degrees. Tomorrow there is a chance
of rain in the afternoon, so remember to bring an umbrella if you are going outside.
Please read the instructions carefully before you begin. Write your name at the top of the page, answer
every question, and check your work when you are finished. You have forty-five minutes.
She opened the window and looked at the garden: roses, tulips, daisies and sunflowers were blooming after
the long winter. Birds were singing in the trees, and the air smelled of fresh grass and warm bread.
History shows that great cities grow near rivers, harbors and trade routes. Paris, London, New York, Tokyo,
Cairo and Rome all became centers of culture, science, art, music and commerce.
What time is it? It is half past seven. Where are you going? I am going to the library to return a book.
Why did the chicken cross the road? To get to the other side! How many apples are left? There are three.
The server received the request, checked the cache, scheduled the batch, ran the forward pass, sampled a
token, and streamed the response back to the client. Latency, throughput and memory usage were measured.
Dear customer, thank you for your order. Your package will arrive within 3-5 business days. If you have any
questions, please contact our support team at support@example.com or call (555) 123-4567.
In mathematics, a prime number is a natural number greater than 1 that has no positive divisors other than
1 and itself. The first primes are 2, 3, 5, 7, 11, 13, 17, 19, 23 and 29. Pi is approximately 3.14159.
Water boils at 100 degrees Celsius and freezes at 0 degrees. The Earth orbits the Sun once every 365.25 days,
and the Moon orbits the Earth roughly every 27 days. Light travels about 300,000 kilometers per second.
"Hello," said the teacher. "Good morning," replied the students. 'Let's start,' she said; everyone agreed.
Caf\u00e9, na\u00efve, r\u00e9sum\u00e9, se\u00f1or, \u00fcber, Stra\u00dfe, \u00e5ngstr\u00f6m \u2014 and \u201cquotes\u201d \u2026 \u00a9 2024, 50\u20ac, \u00a310, \u00a5100.
"""

_GSM8K = """\
Question: Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. How many clips did Natalia sell altogether in April and May?
Answer: In May she sold 48 / 2 = 24 clips. Altogether she sold 48 + 24 = 72 clips. The answer is 72
Question: Weng earns $12 an hour for babysitting. Yesterday, she just did 50 minutes of babysitting. How much did she earn?
Answer: Weng earns 12 / 60 = $0.2 per minute. Working 50 minutes, she earned 0.2 x 50 = $10. The answer is 10
Question: Betty is saving money for a new wallet which costs $100. Betty has only half of the money she needs. Her parents decided to give her $15 for that purpose, and her grandparents twice as much as her parents. How much more money does Betty need to buy the wallet?
Answer: Betty has 100 / 2 = $50. Her grandparents gave her 15 * 2 = $30. She needs 100 - 50 - 30 - 15 = $5 more. The answer is 5
Question: James writes a 3-page letter to 2 different friends twice a week. How many pages does he write a year?
Answer: He writes each friend 3 * 2 = 6 pages a week. So he writes 6 * 2 = 12 pages every week. That means he writes 12 * 52 = 624 pages a year. The answer is 624
Question: A robe takes 2 bolts of blue fiber and half that much white fiber. How many bolts in total does it take?
Answer: It takes 2 / 2 = 1 bolt of white fiber. So the total is 2 + 1 = 3 bolts. The answer is 3
Question: Tom has 7 boxes with 6 pencils in each box. He gives away 15 pencils. How many pencils does he have left?
Answer: Tom has 7 * 6 = 42 pencils. After giving away 15 he has 42 - 15 = 27 pencils. The answer is 27
Question: A train travels 60 miles per hour for 3 hours and then 45 miles per hour for 2 hours. How far does it travel?
Answer: First it travels 60 * 3 = 180 miles. Then it travels 45 * 2 = 90 miles. In total 180 + 90 = 270 miles. The answer is 270
Question: What is 6 times 7?
Answer: 6 * 7 = 42. The answer is 42
"""

_CODE = """\
def fibonacci(n: int) -> int:
    \"\"\"Return the n-th Fibonacci number.\"\"\"
    a, b = 0, 1
    for _ in range(n):
        a, b = b, a + b
    return a


class Counter:
    def __init__(self):
        self.counts = {}

    def add(self, key, value=1):
        self.counts[key] = self.counts.get(key, 0) + value
        return self.counts[key]


if __name__ == "__main__":
    import json
    data = {"name": "tiny", "layers": [1, 2, 3], "ok": True, "ratio": 0.5}
    print(json.dumps(data, indent=2))
    for i in range(10):
        if i % 2 == 0 and i != 4:
            print(f"even: {i}")
        else:
            print("odd:", i)

#include <stdio.h>
int main(int argc, char **argv) {
    int total = 0;
    for (int i = 0; i < argc; ++i) { total += i * 2; }
    printf("total = %d\\n", total);
    return 0;
}

SELECT id, name, price FROM products WHERE price > 10.5 ORDER BY price DESC LIMIT 20;
const add = (x, y) => x + y; let items = [1, 2, 3].map((v) => v * 2); console.log(items);
$ pip install -e . && pytest -q tests/ --maxfail=1 # run the tests
<html><body><div class="main"><p>Hello &amp; welcome!</p></div></body></html>
"""


def _training_corpus() -> list[str]:
    lines = (_PROSE + _GSM8K + _CODE).splitlines()
    # Deterministic arithmetic drills so that numbers and operators get merges.
    for a in range(2, 30):
        b = (a * 7) % 13 + 1
        lines.append(f"{a} + {b} = {a + b}, {a} - {b} = {a - b}, {a} * {b} = {a * b}, {a * b} / {b} = {a}.")
    punct = "!?.,;:()[]{}<>+-*/=%&|^~@#$_'\"`\\"
    lines.append(" ".join(punct) + " " + punct)
    lines.append("0123456789 " * 4)
    return [line + "\n" for line in lines]


def _train_tokenizer_object() -> "Any":
    """Train the byte-level BPE (``tokenizers.Tokenizer``); deterministic."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    # No normalizer + byte-level pre-tokenizer/decoder: every UTF-8 string round-trips.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB_SIZE,
        min_frequency=1,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_training_corpus(), trainer=trainer)
    if tok.get_vocab_size() != TOKENIZER_VOCAB_SIZE:
        raise RuntimeError(
            f"tiny tokenizer has {tok.get_vocab_size()} tokens, expected "
            f"{TOKENIZER_VOCAB_SIZE}: the embedded corpus is too small"
        )
    return tok


def build_tokenizer(out_dir: str) -> "PreTrainedTokenizerFast":
    """Build the tiny tokenizer, ``save_pretrained`` it into ``out_dir`` and return it.

    bos is NOT prepended by ``encode`` (no post-processor template); the chat
    template emits it explicitly.
    """
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=_train_tokenizer_object(),
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        extra_special_tokens=[SYSTEM_TOKEN, USER_TOKEN, ASSISTANT_TOKEN],
        add_bos_token=False,
        add_eos_token=False,
        model_max_length=4096,
        clean_up_tokenization_spaces=False,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (BOS_TOKEN_ID, EOS_TOKEN_ID)
    os.makedirs(out_dir, exist_ok=True)
    tokenizer.save_pretrained(out_dir)
    return tokenizer


# ---------------------------------------------------------------------------
# Model config
# ---------------------------------------------------------------------------

_YARN_ROPE = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 1024,  # 4096 / factor: consistent yarn
    "beta_fast": 32,
    "beta_slow": 1,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
}

_COMMON_DEFAULTS: dict[str, Any] = dict(
    vocab_size=TOKENIZER_VOCAB_SIZE,
    hidden_size=128,
    intermediate_size=256,
    moe_intermediate_size=64,
    num_hidden_layers=4,
    first_k_dense_replace=1,
    num_attention_heads=4,
    num_key_value_heads=4,
    q_lora_rank=64,
    kv_lora_rank=64,
    qk_nope_head_dim=32,
    qk_rope_head_dim=16,
    v_head_dim=32,
    n_routed_experts=8,
    n_shared_experts=1,
    num_experts_per_tok=2,
    n_group=2,
    topk_group=1,
    norm_topk_prob=True,
    routed_scaling_factor=2.5,
    max_position_embeddings=4096,
    initializer_range=0.05,
    tie_word_embeddings=False,
    bos_token_id=BOS_TOKEN_ID,
    eos_token_id=EOS_TOKEN_ID,
    pad_token_id=PAD_TOKEN_ID,
)
# index_topk (32) is far below max_position_embeddings, so sparse selection is
# really exercised once the context exceeds 32 tokens.
_INDEXER_DEFAULTS: dict[str, Any] = dict(index_n_heads=16, index_head_dim=64, index_topk=32)

DEFAULT_CONFIGS: dict[str, dict[str, Any]] = {
    "deepseek_v32": {**_COMMON_DEFAULTS, **_INDEXER_DEFAULTS, "rope_parameters": _YARN_ROPE},
    "glm_moe_dsa": {
        **_COMMON_DEFAULTS,
        **_INDEXER_DEFAULTS,
        "n_group": 1,
        "topk_group": 1,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    },
    # No MTP weights are generated, so do not advertise an MTP layer (HF defaults to 1).
    "deepseek_v3": {**_COMMON_DEFAULTS, "rope_parameters": _YARN_ROPE, "num_nextn_predict_layers": 0},
}

# GlmMoeDsaConfig consumes these in __post_init__ to derive ``indexer_types``.
_GLM_INDEXER_KWARGS = ("index_topk_freq", "index_skip_topk_offset", "index_topk_pattern")


def _config_class(arch: str) -> type:
    import transformers

    names = {
        "deepseek_v32": "DeepseekV32Config",
        "glm_moe_dsa": "GlmMoeDsaConfig",
        "deepseek_v3": "DeepseekV3Config",
    }
    if arch not in names:
        raise ValueError(f"unknown tiny arch {arch!r}; choose one of {list(ARCHS)}")
    return getattr(transformers, names[arch])


def make_tiny_config(arch: str = "deepseek_v32", **overrides: Any) -> "PreTrainedConfig":
    """The tiny HF config for ``arch`` with ``overrides`` applied (any HF config field)."""
    cls = _config_class(arch)
    kwargs = copy.deepcopy(DEFAULT_CONFIGS[arch])
    kwargs.update(copy.deepcopy(overrides))
    cfg = cls(**kwargs)
    # Make sure the schedule inputs are persisted as plain config.json fields
    # (not only the derived ``indexer_types``), whatever __post_init__ did with them.
    for key in _GLM_INDEXER_KWARGS:
        if key in overrides:
            setattr(cfg, key, copy.deepcopy(overrides[key]))
    return cfg


# ---------------------------------------------------------------------------
# Portable random numbers
# ---------------------------------------------------------------------------


def _portable_normal(n: int, std: float, key: str) -> "Any":
    """~N(0, std^2) float64 samples, bit-identical on every platform.

    Irwin-Hall(4) from PCG64 raw 64-bit output: only integer ops and correctly
    rounded IEEE +,-,* are used (no libm / SIMD transcendental functions).
    Bounded at +-3.46 std, which is fine for random test weights.
    """
    import numpy as np

    seed = int.from_bytes(hashlib.sha256(key.encode()).digest()[:16], "little")
    raw = np.random.PCG64(seed).random_raw(4 * n).reshape(4, n)
    u = (raw >> np.uint64(11)).astype(np.float64) * (1.0 / 9007199254740992.0)  # [0, 1)
    s = ((u[0] + u[1]) + (u[2] + u[3])) - 2.0  # variance 1/3
    return s * (std * 1.7320508075688772)  # * sqrt(3)


def _redraw_(tensor: "torch.Tensor", std: float, key: str) -> None:
    import torch

    values = _portable_normal(tensor.numel(), std, key)
    with torch.no_grad():
        tensor.copy_(torch.from_numpy(values).reshape(tensor.shape).to(tensor.dtype))


def _seed_everything(seed: int) -> None:
    import numpy as np
    import torch

    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


# ---------------------------------------------------------------------------
# Checkpoint
# ---------------------------------------------------------------------------


def make_tiny_checkpoint(
    out_dir: str,
    arch: str = "deepseek_v32",
    seed: int = 0,
    dtype: str = "float32",
    mtp_layer: bool = False,
    fp8_block_size: tuple[int, int] | None = None,
    **overrides: Any,
) -> str:
    """Write a tiny random ``arch`` checkpoint plus tokenizer into ``out_dir``; return it.

    ``mtp_layer``: also store a NextN / MTP draft layer (``model.layers.{num_hidden_layers}.*``,
    ``num_nextn_predict_layers = 1``), as DeepSeek-V3.2 and GLM-5 checkpoints do.

    ``fp8_block_size``: save the linears in DeepSeek's block-FP8 format with that block
    (model_loader/fp8_checkpoint.py; the rest stays in ``dtype``).

    ``overrides`` update the default tiny config (e.g. ``num_hidden_layers=6``,
    ``index_topk_freq=4``, ``rope_parameters={...}``). The result depends only on the
    arguments (and the transformers version, through config.json contents).
    """
    import torch
    from transformers import AutoModelForCausalLM

    if dtype not in DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}; choose one of {list(DTYPES)}")
    cfg = make_tiny_config(arch, **overrides)

    _seed_everything(seed)
    with torch.device("cpu"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.eval()

    std = float(cfg.initializer_range)
    with torch.no_grad():
        for name, param in model.named_parameters():
            # HF init: constant tensors (norm weights = 1, biases = 0) stay; every
            # normal_-initialised one is redrawn portably (see module docstring).
            flat = param.detach().reshape(-1)
            if flat.numel() > 0 and bool((flat == flat[0]).all()):
                continue
            _redraw_(param, std, f"tiny-models/{seed}/{name}")
        # Non-zero routing correction bias, so the bias path of grouped top-k routing
        # is exercised (HF initialises it to zeros).
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                _redraw_(buf, 0.02, f"tiny-models/{seed}/{name}")

    if dtype != "float32":
        target = getattr(torch, dtype)
        model.to(target)
        # Real checkpoints keep the routing bias in fp32 (HF marks it
        # _keep_in_fp32_modules_strict); keep that layout.
        for module in model.modules():
            bias = getattr(module, "e_score_correction_bias", None)
            if isinstance(bias, torch.Tensor):
                module.e_score_correction_bias = bias.to(torch.float32)
        model.config.dtype = target

    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    if mtp_layer:
        _add_mtp_layer(out_dir, cfg.num_hidden_layers, seed)
    if fp8_block_size is not None:
        from sglang.srt.model_loader.fp8_checkpoint import quantize_checkpoint_fp8

        quantize_checkpoint_fp8(out_dir, tuple(fp8_block_size))
    build_tokenizer(out_dir)
    return out_dir


def _add_mtp_layer(out_dir: str, n_layers: int, seed: int) -> None:
    """Append a random MTP layer shaped like the last decoder layer (plus enorm / hnorm / eh_proj /
    shared_head.norm; embedding and head shared with the target, as DeepSeek's checkpoints do)."""
    import torch
    from safetensors.torch import load_file, save_file

    files = sorted(f for f in os.listdir(out_dir) if f.endswith(".safetensors"))
    if len(files) != 1:
        raise ValueError(f"expected one safetensors file in {out_dir}, found {files}")
    path = os.path.join(out_dir, files[0])
    tensors = load_file(path)
    src, dst = f"model.layers.{n_layers - 1}.", f"model.layers.{n_layers}."
    g = torch.Generator().manual_seed(seed + 1000)
    for name in [k for k in tensors if k.startswith(src)]:
        t = tensors[name]
        noise = (torch.randn(t.shape, generator=g) * 0.02).to(t.dtype) if t.dtype.is_floating_point else 0
        tensors[name.replace(src, dst, 1)] = (t + noise).contiguous()
    h = tensors["model.norm.weight"].shape[0]
    dt = tensors["model.norm.weight"].dtype
    for name in ("enorm", "hnorm", "shared_head.norm"):
        tensors[f"{dst}{name}.weight"] = (1 + 0.1 * torch.randn(h, generator=g)).to(dt)
    tensors[f"{dst}eh_proj.weight"] = (0.05 * torch.randn(h, 2 * h, generator=g)).to(dt)
    save_file(tensors, path, metadata={"format": "pt"})
    cfg_path = os.path.join(out_dir, "config.json")
    with open(cfg_path) as f:
        config = json.load(f)
    config["num_nextn_predict_layers"] = 1
    with open(cfg_path, "w") as f:
        json.dump(config, f, indent=2)


# ---------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------


def _parse_value(text: str) -> Any:
    """JSON when it parses (ints, floats, bools, lists, dicts), else the raw string."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def _parse_overrides(items: list[str]) -> dict[str, Any]:
    overrides: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"--set expects key=value, got {item!r}")
        overrides[key.strip()] = _parse_value(value)
    return overrides


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Build a tiny random checkpoint + tokenizer.")
    parser.add_argument("--arch", choices=ARCHS, default="deepseek_v32")
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", choices=DTYPES, default="float32")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="config override; VALUE is parsed as JSON when possible (repeatable)",
    )
    args = parser.parse_args(argv)
    out = make_tiny_checkpoint(
        args.out, arch=args.arch, seed=args.seed, dtype=args.dtype, **_parse_overrides(args.set)
    )
    print(out)


if __name__ == "__main__":
    main()
