"""ServerArgs: every flag, its default and its validation, in one place.

Fields are grouped by concern; argparse is generated from the fields (defaults, help and
choices are defined once, here). `validate()` runs one small validator per group (methods of the
flag groups' mixins in `server_args_checks/`) and raises `ServerArgsError` naming the flag and the
reason; `resolve()` fills the "auto" values before the
runtime reads them (the resolved copy is what gets logged and passed on).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
from dataclasses import dataclass, field
from typing import Any, Callable

DTYPE_CHOICES = ["auto", "float32", "bfloat16", "float16"]
DEVICE_CHOICES = ["auto", "cpu", "cuda"]
SCHEDULE_POLICIES = ["fcfs", "lpm"]
SPECULATIVE_ALGORITHMS = ["EAGLE", "NEXTN"]
LOG_LEVELS = ["debug", "info", "warning", "error", "critical"]
LOAD_FORMATS = ["auto", "safetensors", "dummy"]
HICACHE_WRITE_POLICIES = ["write_through", "write_through_selective", "write_back"]
HICACHE_IO_BACKENDS = ["direct", "kernel"]
HICACHE_MEM_LAYOUTS = ["layer_first", "page_first"]
# Choices that name code live beside that code (import-light modules), so they cannot drift.
from sglang.srt.errors import ServerArgsError  # noqa: E402,F401  (importable from here: users catch it)
from sglang.srt.layers.attention.attention_registry import (  # noqa: E402
    CP_MODE_ALIASES,
    MLA_PATHS,
    NSA_BACKEND_CHOICES,
)
from sglang.srt.mem_cache.cp_page_map import CP_MODES  # noqa: E402
from sglang.srt.mem_cache.index_k_format import INDEX_K_DTYPE_NAMES  # noqa: E402
from sglang.srt.mem_cache.kv_fp8_format import KV_CACHE_DTYPES  # noqa: E402
from sglang.srt.layers.moe.moe_registry import MOE_RUNNER_BACKENDS  # noqa: E402
from sglang.srt.layers.quantization import FP8_ACTIVATION_DTYPES, QUANTIZATION_METHODS  # noqa: E402
from sglang.srt.constrained.grammar_registry import GRAMMAR_BACKENDS  # noqa: E402
from sglang.srt.disaggregation import DISAGGREGATION_MODES, TRANSFER_BACKENDS  # noqa: E402
from sglang.srt.mem_cache.storage.registry import PREFETCH_POLICIES, STORAGE_BACKEND_NAMES  # noqa: E402
from sglang.srt.server_args_checks import (  # noqa: E402
    DisaggregationChecks,
    HiCacheChecks,
    ModelChecks,
    ParallelChecks,
    ServingChecks,
    SpeculativeChecks,
)


def _f(default: Any, help: str, group: str, choices: list | None = None, **extra: Any):
    return field(default=default, metadata={"help": help, "group": group, "choices": choices, **extra})


@dataclass
class ServerArgs(ModelChecks, ParallelChecks, ServingChecks, SpeculativeChecks, HiCacheChecks, DisaggregationChecks):
    # -- model ------------------------------------------------------------------------------
    model_path: str | None = _f(None, "HF model directory or builtin:NAME (tiny local model).", "model",
                                required=True)
    tokenizer_path: str | None = _f(None, "Tokenizer directory (default: the model path).", "model")
    trust_remote_code: bool = _f(False, "Allow custom code from the model directory.", "model")
    dtype: str = _f("auto", "Compute dtype; auto = the checkpoint's.", "model", DTYPE_CHOICES)
    context_length: int | None = _f(None, "Max tokens per request (prompt + output); default: the model's.",
                                    "model")
    json_model_override_args: str = _f("", "JSON object merged into the HF config.", "model")
    served_model_name: str | None = _f(None, "Model name reported by the API (default: model path).", "model")
    load_format: str = _f("auto", "auto/safetensors: load the checkpoint's weights; dummy: random weights from "
                          "config.json alone (benchmarks of real shapes without the checkpoint).", "model",
                          LOAD_FORMATS)
    quantization: str | None = _f(None, "Quantise a model-dtype checkpoint's weights at load: fp8 (DeepSeek's 128 x "
                                  "128 block FP8, as the FP8 checkpoints ship). FP8 checkpoints are served as FP8 "
                                  "without it.", "model", QUANTIZATION_METHODS)
    dequantize_fp8_weights: bool = _f(False, "Dequantise an FP8 checkpoint's weights to --dtype at load (the "
                                      "reference path; twice the weight memory).", "model")
    fp8_activation_dtype: str | None = _f(None, "FP8 weights: fp8_e4m3 (default: activations quantised per token "
                                          "in groups of 128, the checkpoints' dynamic scheme) or model_dtype "
                                          "(activations stay in --dtype).", "model", FP8_ACTIVATION_DTYPES)

    # -- runtime ----------------------------------------------------------------------------
    device: str = _f("auto", "Device; auto = cuda when available, else cpu.", "runtime", DEVICE_CHOICES)
    tp_size: int = _f(1, "Tensor parallel size.", "runtime")
    random_seed: int | None = _f(None, "Seed for sampling without a per-request seed.", "runtime")
    disable_cuda_graph: bool = _f(False, "Run decode eagerly instead of replaying CUDA graphs (graphs need "
                                  "CUDA and a graph-capturable decode backend: triton).", "runtime")
    cuda_graph_max_bs: int = _f(160, "Largest decode batch captured in a CUDA graph; larger batches run "
                                "eagerly.", "runtime")

    # -- parallelism (ranks are processes; several nodes start the same command) ------------
    attn_cp_size: int = _f(1, "Attention context-parallel size: ranks that split a prefill's tokens (needs "
                           "--enable-nsa-prefill-context-parallel; equals --tp-size).", "parallel")
    enable_nsa_prefill_context_parallel: bool = _f(False, "Split prefill (and decode) tokens over the --attn-cp-size "
                                                   "ranks with shared KV: each rank stores the KV pages it computed.",
                                                   "parallel", aliases=["--enable-prefill-cp"])
    nsa_prefill_cp_mode: str = _f("round-robin-split", "CP token split: in-seq-split (zigzag: 2 x cp blocks, rank r "
                                  "takes blocks r and 2cp-1-r, page-aligned) or round-robin-split (token/page i -> "
                                  "rank i %% cp); --cp-strategy zigzag / interleave are upstream's newer names.",
                                  "parallel", [*CP_MODES, *CP_MODE_ALIASES],
                                  aliases=["--cp-strategy"])
    ep_size: int = _f(1, "Expert-parallel size: MoE experts sharded over this many ranks (1 or --tp-size).",
                      "parallel")
    moe_a2a_backend: str = _f("none", "Expert-parallel token dispatch under CP: none (all-to-all over "
                              "torch.distributed) or deepep (needs the deep_ep package).", "parallel",
                              ["none", "deepep"])
    nnodes: int = _f(1, "Number of nodes; start the same command on each with its --node-rank.", "parallel")
    node_rank: int = _f(0, "This node's rank (0 serves HTTP).", "parallel")
    dist_init_addr: str | None = _f(None, "host:port of node 0 for torch.distributed (needed with --nnodes > 1).",
                                    "parallel")
    dist_timeout: int = _f(300, "Seconds a collective may wait for the other ranks before this rank fails "
                           "(a dead rank then stops the server instead of hanging it).", "parallel")

    # -- memory -----------------------------------------------------------------------------
    mem_fraction_static: float | None = _f(None, "Fraction of GPU memory for weights + KV cache (upstream's meaning); "
                                           "the rest must hold the activations of the largest prefill step and "
                                           "the CUDA graphs (checked at start-up). Default: auto, the KV cache "
                                           "takes all but that reserve (the start-up log prints the plan).",
                                           "memory")
    max_total_tokens: int | None = _f(None, "KV cache capacity in tokens (overrides the memory budget).",
                                      "memory")
    page_size: int | None = _f(None, "Tokens per KV page; default 64 for DSA on CUDA, else 1.", "memory")
    max_running_requests: int | None = _f(None, "Max requests decoding at once.", "memory")

    # -- HiCache L3 storage (upstream's names) -------------------------------------------------
    hicache_storage_backend: str | None = _f(None, "HiCache storage tier under host memory: file (pages as files in "
                                             "a directory) or mooncake (Mooncake Store).", "hicache",
                                             STORAGE_BACKEND_NAMES)
    hicache_storage_backend_extra_config: str | None = _f(None, "JSON object of backend settings, e.g. "
                                                          "'{\"file_path\": \"/data/hicache\"}' (file) or "
                                                          "'{\"master_server_address\": \"host:50051\"}' (mooncake).",
                                                          "hicache")
    hicache_storage_prefetch_policy: str = _f("best_effort", "When a storage prefetch stops: best_effort (when the "
                                              "request is scheduled), wait_complete, or timeout.", "hicache",
                                              PREFETCH_POLICIES)

    # -- scheduling ---------------------------------------------------------------------------
    chunked_prefill_size: int = _f(8192, "Max prefill tokens per step; -1 disables chunking.", "scheduling")
    max_prefill_tokens: int = _f(16384, "Max new prompt tokens admitted per prefill batch.", "scheduling")
    disable_radix_cache: bool = _f(False, "Disable prefix caching.", "scheduling")
    schedule_policy: str = _f("fcfs", "Waiting-queue order: fcfs, or lpm (longest cached prefix first).",
                              "scheduling", SCHEDULE_POLICIES)
    enable_mixed_chunk: bool = _f(False, "Run decode requests inside prefill batches.", "scheduling")
    disable_overlap_schedule: bool = _f(False, "Process each step's results before preparing the next step. "
                                        "By default (overlap) step n+1 is prepared and launched while step n "
                                        "runs: its input ids come from a device-resident token table.",
                                        "scheduling")

    # -- hierarchical cache (HiCache: a host-memory tier under the radix cache; upstream names) ------
    enable_hierarchical_cache: bool = _f(False, "Keep KV evicted from the device in host memory and load it back "
                                         "layer by layer when its prefix hits again (needs the radix cache).",
                                         "hicache")
    hicache_ratio: float = _f(2.0, "Host KV pool size as a multiple of the device KV pool's tokens.", "hicache")
    hicache_size: float = _f(0.0, "Host KV pool size in GB (target + draft mirrors); overrides --hicache-ratio "
                             "when > 0.", "hicache")
    hicache_write_policy: str = _f("write_through", "When device KV is backed up to host: write_through (on "
                                   "insert), write_through_selective (on a node's second hit), write_back (on "
                                   "device eviction).", "hicache", HICACHE_WRITE_POLICIES)
    hicache_io_backend: str = _f("direct", "Host<->device page copies: direct (one cudaMemcpyAsync per run of "
                                 "consecutive host pages, scattered device pages through a staging buffer) or "
                                 "kernel (a Triton page-copy kernel reading / writing pinned host memory; GPU "
                                 "only).", "hicache", HICACHE_IO_BACKENDS)
    hicache_mem_layout: str = _f("layer_first", "Host pool layout: layer_first (one buffer per layer) or "
                                 "page_first (a page's layers contiguous).", "hicache", HICACHE_MEM_LAYOUTS)

    # -- http ---------------------------------------------------------------------------------
    host: str = _f("127.0.0.1", "HTTP host.", "http")
    port: int = _f(30000, "HTTP port.", "http")
    api_key: str | None = _f(None, "Require 'Authorization: Bearer KEY' on every route but /health.", "http")
    enable_metrics: bool = _f(False, "Serve Prometheus metrics at /metrics.", "http")
    graceful_shutdown_timeout: float = _f(20.0, "On SIGTERM / Ctrl-C: stop accepting requests, let those in flight "
                                          "finish for up to this many seconds, then abort the rest and exit.",
                                          "http")

    # -- OpenAI API: chat templates, reasoning and tool calls ------------------------------------
    chat_template: str | None = _f(None, "Jinja chat template file replacing the tokenizer's (without one, "
                                   "DeepSeek-V3.2 uses its Python prompt encoder).", "api")
    reasoning_parser: str | None = _f(None, "Split chat output into reasoning_content and content: deepseek-v3 "
                                      "(V3.1/V3.2; per request chat_template_kwargs {\"thinking\": true}), glm45 "
                                      "(GLM-4.5..GLM-5; enable_thinking), deepseek-r1, qwen3, ...", "api")
    tool_call_parser: str | None = _f(None, "Parse tool calls out of chat output (tools / tool_choice auto): "
                                      "deepseekv32, deepseekv31, deepseekv3, glm (= glm45), glm47 (GLM-4.7 / GLM-5).",
                                      "api")

    # -- logging ------------------------------------------------------------------------------
    log_level: str = _f("info", "Log level.", "logging", LOG_LEVELS)
    log_requests: bool = _f(False, "Log every request's metadata (id, token counts, sampling params, latency) "
                            "and the HTTP access log.", "logging")

    # -- endpoints, metrics and stats logs (upstream names) -------------------------------------
    max_payload_size: int = _f(32 * 2**20, "Largest HTTP request body in bytes; larger ones get a 413 error.", "http")
    enable_return_hidden_states: bool = _f(False, "Allow requests to ask for return_hidden_states (the last layer's "
                                           "hidden state per token, in meta_info); others get a 400.", "http")
    decode_log_interval: int = _f(40, "Log a 'Decode batch.' stats line every N decode steps (prefill batches log "
                                  "one line each, at INFO).", "logging")

    # -- NSA / DSA ------------------------------------------------------------------------------
    nsa_index_k_dtype: str = _f("fp8_e4m3", "Indexer K cache dtype: fp8_e4m3 (+ fp32 scales, like upstream), "
                                "or an exact bfloat16 / float32 mode (matches the unquantised reference).",
                                "nsa", INDEX_K_DTYPE_NAMES)
    kv_cache_dtype: str = _f("auto", "MLA KV cache dtype: auto (the model dtype) or fp8_e4m3 (DeepSeek's FP8 "
                             "layout: e4m3 latent with one fp32 scale per 128 values + bf16 rope, 656 B/token/layer "
                             "on V3.2; ~2x the tokens in the same memory).", "nsa", KV_CACHE_DTYPES)
    enable_deterministic_inference: bool = _f(False, "Batch-invariant kernels for the dense projections, norms and "
                                              "MoE (fixed reduction order): a prompt gives the same tokens and "
                                              "logprobs alone or in any batch, at some speed cost.", "nsa")
    nsa_prefill_backend: str = _f("auto", "Attention + indexer kernels for prefill: triton (sgl_kernel) or "
                                  "torch (the reference); auto = triton on CUDA, torch on CPU.", "nsa",
                                  NSA_BACKEND_CHOICES)
    nsa_decode_backend: str = _f("auto", "Attention + indexer kernels for decode (as --nsa-prefill-backend; may "
                                 "differ from it).", "nsa", NSA_BACKEND_CHOICES)
    moe_runner_backend: str = _f("auto", "Expert computation: triton (fused MoE kernels) or torch (reference "
                                 "loop; its host sync keeps decode out of CUDA graphs); auto = triton on CUDA, "
                                 "torch on CPU.", "nsa", MOE_RUNNER_BACKENDS)
    nsa_index_topk_freq: int | None = _f(None, "IndexCache: run the DSA indexer every N layers; the layers between "
                                         "reuse the previous top-k (1 = every layer; default: the checkpoint's).",
                                         "nsa")
    nsa_index_topk_offset: int | None = _f(None, "IndexCache: layer offset of the skip formula "
                                           "max(layer - offset + 1, 0) % freq (> 0; default 2).", "nsa")
    nsa_index_topk_pattern: str | None = _f(None, "IndexCache: explicit per-layer schedule, one 'F' (full) or 'S' "
                                            "(shared) per layer; excludes --nsa-index-topk-freq.", "nsa")
    enable_two_batch_overlap: bool = _f(False, "Two-batch overlap (TBO) of compute and expert-parallel communication.",
                                        "nsa")
    mla_attn_path: str = _f("auto", "MLA formulation: auto (plain for prefill, absorbed for decode), "
                            "or force one (debug / equivalence tests).", "nsa", MLA_PATHS)

    # -- speculative decoding (upstream's names) ------------------------------------------------
    speculative_algorithm: str | None = _f(None, "Speculative decoding: EAGLE (the draft model's MTP/NextN layer "
                                           "proposes tokens the target verifies) or NEXTN (the same, with the "
                                           "checkpoint's own MTP layer). Greedy output equals plain decoding.",
                                           "speculative", SPECULATIVE_ALGORITHMS)
    speculative_draft_model_path: str | None = _f(None, "Checkpoint whose MTP layer drafts (default: the target "
                                                  "checkpoint's own).", "speculative")
    speculative_num_steps: int = _f(3, "Draft steps per verify.", "speculative")
    speculative_eagle_topk: int = _f(1, "Draft candidates per step (1 = a chain; trees are not supported).",
                                     "speculative")
    speculative_num_draft_tokens: int | None = _f(None, "Tokens the target verifies per step (default and only "
                                                  "value with topk 1: num_steps + 1).", "speculative")
    speculative_token_map: str | None = _f(None, "FR-Spec: a file of hot token ids (.pt tensor/list, .json list or "
                                           "text); the draft's lm_head projects onto those tokens only (cheaper "
                                           "draft steps; output unchanged, acceptance may drop).", "speculative")
    speculative_adaptive: bool = _f(False, "Switch drafting off while too few drafts are accepted to pay for a "
                                    "speculative step (plain one-row steps, a speculative probe every 16 steps; "
                                    "on again once acceptance recovers). Output unchanged.", "speculative")

    # -- PD disaggregation (upstream's names) ---------------------------------------------------
    disaggregation_mode: str = _f("null", "Prefill/decode disaggregation: prefill (compute prompts, send their KV "
                                  "to a decode server), decode (receive KV, then decode) or null (both here).",
                                  "disaggregation", DISAGGREGATION_MODES)
    disaggregation_transfer_backend: str = _f("mooncake", "KV transfer engine: mooncake (Mooncake Transfer Engine; "
                                              "TCP on CPU, RDMA where NICs exist), cuda_ipc (servers on one host's GPUs: "
                                              "device-to-device copies) or fake (in-process, tests only).",
                                              "disaggregation", TRANSFER_BACKENDS)
    disaggregation_bootstrap_port: int = _f(8998, "Prefill server: port where decode servers register the pages a "
                                            "request's KV goes to (CP rank 0 listens).", "disaggregation")

    # -- structured outputs / custom logit processors ------------------------------------------
    grammar_backend: str = _f("xgrammar", "Grammar backend for json_schema / regex / ebnf / structural_tag "
                              "requests; none = structured outputs disabled (such requests get a 400).",
                              "constrained", GRAMMAR_BACKENDS)
    constrained_json_disable_any_whitespace: bool = _f(False, "json_schema: allow only the compact JSON layout "
                                                       "instead of any whitespace between tokens.", "constrained")
    enable_custom_logit_processor: bool = _f(False, "Accept requests' custom_logit_processor (dill-serialised "
                                             "code run in the server: enable for trusted clients only).",
                                             "constrained")

    # ------------------------------------------------------------------------------------------
    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        groups: dict[str, argparse._ArgumentGroup] = {}
        for f in dataclasses.fields(ServerArgs):
            md = f.metadata
            g = groups.setdefault(md["group"], parser.add_argument_group(md["group"]))
            flag = "--" + f.name.replace("_", "-")
            # argparse %-formats help text (for %(default)s); a literal % must not be read as a code.
            help_text = md["help"].replace("%", "%%")
            flags = [flag, *md.get("aliases", [])]
            if f.type in ("bool", bool):
                g.add_argument(*flags, action="store_true", default=f.default, help=help_text, dest=f.name)
                continue
            kind = _cli_type(f.type)
            g.add_argument(*flags, type=kind, default=f.default, choices=md.get("choices"), help=help_text,
                           required=md.get("required", False), dest=f.name)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> "ServerArgs":
        return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> "ServerArgs":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise ServerArgsError(unknown[0], f"unknown argument(s) {unknown}")
        return cls(**kwargs)

    def validate(self) -> None:
        """Every group's checks (server_args_checks/), in a fixed order: the first bad flag is the one named."""
        for check in (self._check_model, self._check_runtime, self._check_parallel, self._check_memory,
                      self._check_scheduling, self._check_http, self._check_api, self._check_logging,
                      self._check_nsa, self._check_endpoints, self._check_speculative, self._check_hicache_storage,
                      self._check_hicache, self._check_disaggregation):
            check()

    def resolve(self) -> "ServerArgs":
        """A validated copy with every 'auto' / None default resolved."""
        self.validate()
        from sglang.srt.utils.common import resolve_device

        device = resolve_device(self.device)
        out = dataclasses.replace(
            self,
            device=device,
            tokenizer_path=self.tokenizer_path or self.model_path,
            served_model_name=self.served_model_name or self.model_path,
            random_seed=self.random_seed if self.random_seed is not None else random.randint(0, 2**30),
            page_size=self.page_size or (64 if device == "cuda" else 1),
            nsa_prefill_cp_mode=CP_MODE_ALIASES.get(self.nsa_prefill_cp_mode, self.nsa_prefill_cp_mode),
        )
        if out.chunked_prefill_size > 0 and out.chunked_prefill_size % out.page_size:
            raise ServerArgsError("chunked_prefill_size", f"must be a multiple of --page-size {out.page_size}")
        from sglang.srt.layers.attention.attention_registry import backend_unrunnable_reason, resolve_backend_name
        from sglang.srt.layers.moe.moe_registry import resolve_moe_runner_backend

        for name in ("nsa_prefill_backend", "nsa_decode_backend"):
            backend = resolve_backend_name(getattr(out, name), device)
            reason = backend_unrunnable_reason(backend, device)
            if reason:
                raise ServerArgsError(name, reason)
            setattr(out, name, backend)
        if out.enable_deterministic_inference and device == "cuda":
            torch_paths = [n for n in ("nsa_prefill_backend", "nsa_decode_backend") if getattr(out, n) == "torch"]
            if torch_paths:  # its batched einsums go through cuBLAS, whose kernel choice follows the batch
                raise ServerArgsError("enable_deterministic_inference", f"needs the triton attention backends on "
                                      f"GPUs (--{torch_paths[0].replace('_', '-')} is torch)")
        out.moe_runner_backend = resolve_moe_runner_backend(out.moe_runner_backend, device)
        reason = backend_unrunnable_reason(out.moe_runner_backend, device)
        if reason:
            raise ServerArgsError("moe_runner_backend", reason)
        return out

    def model_overrides(self) -> dict:
        return json.loads(self.json_model_override_args) if self.json_model_override_args.strip() else {}


def _cli_type(annotation: Any) -> Callable:
    text = str(annotation)
    if "int" in text:
        return int
    if "float" in text:
        return float
    return str


def prepare_server_args(argv: list[str]) -> ServerArgs:
    parser = argparse.ArgumentParser(prog="python -m sglang.launch_server",
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ServerArgs.add_cli_args(parser)
    return ServerArgs.from_cli_args(parser.parse_args(argv))
