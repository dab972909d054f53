"""NSA context parallel with shared KV on real processes (gloo): greedy tokens and logprobs equal to
cp = 1 for both split modes, page sizes 1 and 64, batched requests of lengths that are and are not
multiples of the page size and of 2 x cp, cache-hit tiny extends (fewer new tokens than ranks);
padding rows filled with garbage change nothing; the narrow gather moves cp x bs x hidden; EP
all-to-all equals local experts; KV per rank is 1/cp."""

from __future__ import annotations

import json
import os

import pytest
import torch

from sglang.srt.testing.multi_rank import Case, run_case, run_multi_rank

# SGLANG_TEST_DEVICE=cuda: ranks on GPUs (NCCL with a GPU per rank; on fewer GPUs they share over gloo)
DEVICE = os.environ.get("SGLANG_TEST_DEVICE", "cpu")
# fp32 tiny models; CP changes only which rank computes a row. On CPU every row rounds the same in any
# batch; on GPUs cuBLAS picks kernels by the number of rows, so a rank's slice rounds differently in
# the last bits, which can move a near-tie of the FP8 index scores (measured on the H200: 2e-3).
LOGPROB_TOL = 1e-4 if DEVICE == "cpu" else 5e-3


def _prompts(seed: int, lens: tuple[int, ...]) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 250, (n,), generator=g).tolist() for n in lens]


@pytest.fixture(scope="module")
def model_paths(builtin_path):
    return {m: builtin_path(m) for m in ("tiny-deepseek-v32", "tiny-glm-moe-dsa")}


def _cases(model_paths, cp: int) -> list[Case]:
    prompts = _prompts(0, (37, 70, 5, 64, 130))  # > index_topk (32), < and = page multiples, < 2cp
    prefix = prompts[1]
    tiny = [prefix + [7], prefix[:64] + [9, 11]]  # cache hits: 1-2 new tokens (fewer than ranks)
    cases = []
    models = model_paths.items() if cp == 2 else list(model_paths.items())[:1]  # CI time: cp 3 on V3.2
    for model, key in models:
        for mode in ("in-seq-split", "round-robin-split"):
            for ps in (1, 64):
                sa = dict(model_path=key, enable_nsa_prefill_context_parallel=True, nsa_prefill_cp_mode=mode,
                          page_size=ps, chunked_prefill_size=-1, device=DEVICE)
                cases.append(Case(f"{model}/{mode}/p{ps}", sa, prompts, 6, followups=tiny, return_logprob=True))
    return cases


_REFS: dict[tuple, dict] = {}


def _reference(case: Case) -> dict:
    """The same requests at cp = 1 (in this process), cached per distinct input."""
    sa = {k: v for k, v in case.server_args.items() if k not in ("enable_nsa_prefill_context_parallel",
                                                                  "nsa_prefill_cp_mode", "ep_size")}
    key = (json.dumps(sa, sort_keys=True), json.dumps(case.prompts), json.dumps(case.followups),
           case.max_new_tokens, case.return_logprob, case.logprob_start_len)
    if key not in _REFS:
        _REFS[key] = run_case(Case(case.name, sa, case.prompts, case.max_new_tokens, case.followups,
                                   case.return_logprob, case.logprob_start_len), 1)
    return _REFS[key]


def _assert_same(got: dict, ref: dict, name: str) -> None:
    keys = [k for k in ref if k != "_stats"]
    assert sorted(keys) == sorted(k for k in got if k != "_stats"), name
    for k in keys:
        assert got[k]["ids"] == ref[k]["ids"], f"{name} {k}: {got[k]['ids']} != {ref[k]['ids']}"
        diff = max((abs(a - b) for a, b in zip(got[k]["logprobs"], ref[k]["logprobs"])), default=0.0)
        assert diff < LOGPROB_TOL, f"{name} {k}: logprob diff {diff}"
    assert got["_stats"]["kv_leak"] is None, got["_stats"]


@pytest.mark.parametrize("cp", [2, 3])
def test_cp_equals_cp1(model_paths, cp):
    cases = _cases(model_paths, cp)
    got = run_multi_rank(cases, cp)
    for case, g in zip(cases, got):
        _assert_same(g, _reference(case), case.name)
        st = g["_stats"]
        # each rank's pool is 1/cp of the logical KV capacity, and the cached requests' pages are
        # spread over the ranks (zigzag / round-robin pages: no rank holds much more than 1/cp)
        assert st["pool_slots"] * cp == st["capacity"], st
        owned = st["owned_pages"]
        assert len(owned) == cp and sum(owned) > 0, st
        assert max(owned) <= sum(owned) / cp + len(case.prompts) + len(case.followups), st
        if case.server_args["page_size"] == 1:
            assert min(owned) > 0, st  # (64-token pages of these short prompts may all land on two ranks)
        assert st["comm"].get("narrow_gather", 0) > 0 and "full_gather" not in st["comm"], st


def test_padding_garbage_and_gathers_and_ep(model_paths):
    key = model_paths["tiny-deepseek-v32"]
    prompts = _prompts(11, (45, 3, 90))
    cp_args = dict(model_path=key, enable_nsa_prefill_context_parallel=True, nsa_prefill_cp_mode="in-seq-split",
                   page_size=1, chunked_prefill_size=-1, device=DEVICE)
    hidden = json.load(open(os.path.join(key, "config.json")))["hidden_size"]
    cases = [
        # dummy rows filled with 1e4 before every layer: nothing changes
        Case("poison", cp_args, prompts, 6, env={"SGLANG_CP_POISON_PADDING": "1"}, return_logprob=True),
        # one forward (prefill only): the narrow gather moves exactly cp x bs x hidden elements
        Case("narrow", cp_args, prompts, 1),
        # input logprobs need every position: the full gather is taken instead
        Case("fallback", cp_args, prompts, 1, return_logprob=True, logprob_start_len=0),
        # experts split over the 2 ranks, tokens moved by all-to-all
        Case("ep", dict(cp_args, ep_size=2), prompts, 6, return_logprob=True),
        # chunked prefill (chunks of 32 on pages of 16) with decode requests mixed into prefill batches
        Case("chunked", dict(cp_args, page_size=16, chunked_prefill_size=32, enable_mixed_chunk=True), prompts, 6,
             return_logprob=True),
        # the Triton kernels (interpreter on CPU) behind the CP view, page size 64
        Case("triton", dict(cp_args, page_size=64, nsa_prefill_backend="triton", nsa_decode_backend="triton",
                            moe_runner_backend="triton"), prompts, 4, return_logprob=True),
    ]
    got = dict(zip([c.name for c in cases], run_multi_rank(cases, 2)))
    ref = _reference(cases[0])
    _assert_same(got["poison"], ref, "poison")
    assert got["poison"]["_stats"]["comm"]["poisoned_rows"] > 0  # the garbage really was there
    # layer-end hooks run on each rank's own pool, once per layer per forward (not per CP view)
    n_layers = json.load(open(os.path.join(key, "config.json")))["num_hidden_layers"]
    ends = got["poison"]["_stats"]["layer_ends"]
    assert ends and ends == list(range(n_layers)) * (len(ends) // n_layers)
    _assert_same(got["ep"], ref, "ep")
    assert got["ep"]["_stats"]["dispatched"] > 0
    assert got["narrow"]["_stats"]["comm"]["narrow_gather"] == 2 * len(prompts) * hidden
    _assert_same(got["chunked"], _reference(cases[4]), "chunked")
    tri_ref = _reference(Case("t", dict(cp_args, page_size=64), prompts, 4, return_logprob=True))
    for k in ("p0", "p1", "p2"):  # kernels vs the torch reference: same tokens, logprobs within 1e-3
        assert got["triton"][k]["ids"] == tri_ref[k]["ids"]
        assert max(abs(a - b) for a, b in zip(got["triton"][k]["logprobs"], tri_ref[k]["logprobs"])) < 1e-3
    fb = got["fallback"]["_stats"]["comm"]
    assert "full_gather" in fb and "narrow_gather" not in fb, fb
    ref_in = _reference(cases[2])
    for k in ("p0", "p1", "p2"):
        a, b = got["fallback"][k]["input_logprobs"], ref_in[k]["input_logprobs"]
        assert len(a) == len(b) and max(abs(x - y) for x, y in zip(a, b)) < LOGPROB_TOL


def test_server_cp2_serves_like_cp1_and_a_killed_rank_stops_it():
    """Through the HTTP server, started as two nodes (--nnodes 2, one rank each): --tp-size 2
    --attn-cp-size 2 with upstream's flag spellings gives cp = 1's greedy tokens; killing one CP
    rank takes both nodes down within --dist-timeout (no hang, no orphans)."""
    import signal
    import time

    import psutil
    import requests

    from sglang.srt.testing.server import ServerProcess

    prompts = ["The capital of France is", "Long context " * 30, "x"]

    def gen(url: str, p: str) -> list[int]:
        return requests.post(url + "/generate", json={"text": p, "sampling_params": {
            "max_new_tokens": 8, "temperature": 0, "ignore_eos": True}}, timeout=300).json()["output_ids"]

    args = ("--max-total-tokens", "4096", "--random-seed", "0", "--page-size", "16")
    with ServerProcess("builtin:tiny-deepseek-v32", *args) as s1:
        ref = [gen(s1.base_url, p) for p in prompts]
    # two "nodes" on this machine: node 1 runs rank 1 only, node 0 serves HTTP (upstream's flags)
    import subprocess
    import sys

    from sglang.srt.testing.multi_rank import free_port

    cp = ("--tp-size", "2", "--attn-cp-size", "2", "--enable-prefill-cp", "--cp-strategy", "zigzag",
          "--dist-timeout", "60", "--nnodes", "2", "--dist-init-addr", f"127.0.0.1:{free_port()}")
    node1 = subprocess.Popen([sys.executable, "-m", "sglang.launch_server", "--model-path",
                              "builtin:tiny-deepseek-v32", *args, *cp, "--node-rank", "1"],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        s = ServerProcess("builtin:tiny-deepseek-v32", *args, *cp, "--node-rank", "0")
    except BaseException:
        node1.kill()
        raise
    try:
        assert [gen(s.base_url, p) for p in prompts] == ref
        st = s.wait_idle()
        assert st["kv_leak"] is None
        # kill rank 1 (node 1's only scheduler, its largest child): node 1 and the server exit
        kids = psutil.Process(s.proc.pid).children(recursive=True)
        rank1 = max(psutil.Process(node1.pid).children(recursive=True), key=lambda k: k.memory_info().rss)
        os.kill(rank1.pid, signal.SIGKILL)
        assert node1.wait(timeout=60) != 0
        assert s.proc.wait(timeout=120) != 0  # rank 0's collective fails within --dist-timeout
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and [k for k in kids if k.is_running()
                                                 and k.status() != psutil.STATUS_ZOMBIE]:
            time.sleep(0.2)
        assert not [k for k in kids if k.is_running() and k.status() != psutil.STATUS_ZOMBIE]
    finally:
        s.stop()
        if node1.poll() is None:
            node1.kill()
