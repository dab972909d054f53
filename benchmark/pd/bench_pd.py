"""PD disaggregation vs one combined server (issue 23), CPU: TTFT, decode tokens/s, KV transfer
bandwidth vs a raw Mooncake loopback copy measured in the same run.

    python benchmark/pd/bench_pd.py [--prompt-len 1024 --max-new-tokens 64 --requests 12] [--v32-kv]

Starts a combined server, and a prefill + decode server (Mooncake over TCP) behind the PD router;
sends the same prompts (token ids, one at a time, streaming) alternately to each side; TTFT = time to
the first streamed token, decode tok/s = (tokens - 1) / (last - first token time). Transfer
bandwidth = bytes the prefill server wrote / seconds inside its transfer calls (its counters), per
request; right after each PD request a raw copy -- Mooncake's own synchronous batch write, the
library used plainly -- moves the same bytes between two Mooncake engines in this process (servers
still up, same load), as one range and split into the same number of ranges the server used,
between buffer regions not touched since (as pool pages are: cold), and once more cache-warm, and
once into an idle receiver process; and once more into that process through MooncakeBackend.write
(the server's own path without the servers). Medians of the per-request values, and medians of the
per-request ratios (each PD copy against the copies made right after it). `--v32-kv`: a small model
(dummy weights) whose KV rows have DeepSeek-V3.2's widths (MLA 512 + 64, index K 128; 8 layers), so a
request moves megabytes rather than the builtin tiny model's ~1.6 KB per token.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time

import torch
from tqdm import tqdm

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "python"))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "e2e"))

from sglang.bench_plot import import_pyplot  # noqa: E402
from sglang.srt.disaggregation.transfer import MooncakeBackend  # noqa: E402
from sglang.srt.testing.pd import PDSetup  # noqa: E402
from sglang.srt.testing.server import ServerProcess  # noqa: E402
from streaming import stream  # noqa: E402


def one_request(base_url: str, ids: list[int], max_new: int) -> tuple[float, float]:
    """(TTFT, decode tokens/s) of one streamed request."""
    r = stream(base_url, ids, max_new, time.perf_counter())
    (first, _), (last, _) = r["events"][0], r["events"][-1]
    n = r["tokens"]
    return first - r["sent"], (n - 1) / (last - first) if n > 1 and last > first else float("nan")


class RawMooncake:
    """Two Mooncake engines in this process (loopback over TCP), buffers registered once. A KV pool's
    pages are not in the CPU caches when they move, so by default each copy uses a new region of
    buffers `slots` times the payload (cold); `hot=True` reuses the first region (cache-warm)."""

    def __init__(self, nbytes: int, slots: int = 24) -> None:
        self.a, self.b = MooncakeBackend(), MooncakeBackend()
        self.nbytes, self.slots, self.k = nbytes, slots, 0
        self.src = torch.randint(0, 255, (nbytes * slots,), dtype=torch.uint8)
        self.dst = torch.zeros_like(self.src)
        self.a.register(self.src.data_ptr(), self.src.numel())
        self.b.register(self.dst.data_ptr(), self.dst.numel())
        # The same copy into another (idle) process: the path a PD transfer takes, minus the servers.
        self.peer = subprocess.Popen([sys.executable, "-c", _RECEIVER, str(self.dst.numel())], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                                     env={**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)})
        self.peer_id, self.peer_ptr = json.loads(self.peer.stdout.readline())
        self.write(nbytes, 1)  # connect
        self.write(nbytes, 1, other_process=True)

    def write(self, nbytes: int, ops: int, hot: bool = False, other_process: bool = False,
              backend: bool = False) -> float:
        """Seconds to write `nbytes` as `ops` equal ranges with Mooncake's own synchronous batch
        write (the raw reference), or with `backend=True` through MooncakeBackend.write (the
        server's path, without the servers)."""
        self.k = 0 if hot else (self.k + 1) % self.slots
        peer, dst_base = (self.peer_id, self.peer_ptr) if other_process else (self.b.session_id, self.dst.data_ptr())
        src, dst = self.src.data_ptr() + self.k * self.nbytes, dst_base + (self.slots - 1 - self.k) * self.nbytes
        step = nbytes // ops
        offs = [i * step for i in range(ops)]
        lens = [step] * (ops - 1) + [nbytes - step * (ops - 1)]
        t = time.perf_counter()
        if backend:
            self.a.write(peer, [src + o for o in offs], [dst + o for o in offs], lens)
        elif self.a.engine.batch_transfer_sync_write(peer, [src + o for o in offs], [dst + o for o in offs], lens):
            raise RuntimeError("raw Mooncake write failed")
        return time.perf_counter() - t

    def close(self) -> None:
        self.peer.stdin.close()
        self.peer.wait(timeout=30)


_RECEIVER = """
import json, sys, torch
from sglang.srt.disaggregation.transfer import MooncakeBackend
b = MooncakeBackend(); dst = torch.zeros(int(sys.argv[1]), dtype=torch.uint8); b.register(dst.data_ptr(), dst.numel())
print(json.dumps([b.session_id, dst.data_ptr()]), flush=True)
sys.stdin.read()
"""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="builtin:tiny-deepseek-v32")
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--requests", type=int, default=12)
    ap.add_argument("--page-size", type=int, default=1)
    ap.add_argument("--v32-kv", action="store_true", help="KV rows of V3.2's widths (dummy weights, 8 layers)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    args.out = args.out or os.path.join(os.path.dirname(__file__), "results",
                                        "pd_cpu_v32kv.json" if args.v32_kv else "pd_cpu.json")
    rng = random.Random(0)
    prompts = [[rng.randrange(5, 900) for _ in range(args.prompt_len)] for _ in range(args.requests)]
    sargs = ("--max-total-tokens", "16384", "--random-seed", "0", "--page-size", str(args.page_size),
             "--disable-radix-cache")  # every prompt is computed and moved in full
    if args.v32_kv:
        from bench_e2e_vs_hf import make_config_dir

        args.model = make_config_dir("deepseek-v32", 8, True, kv_lora_rank=512, qk_rope_head_dim=64,
                                     index_head_dim=128)
        sargs += ("--load-format", "dummy", "--device", "cpu")
    res = {"combined": {"ttft": [], "tps": []}, "pd": {"ttft": [], "tps": []}}
    with ServerProcess(args.model, *sargs) as comb, PDSetup(args.model, *sargs) as pd:
        for url in (comb.base_url, pd.base_url):  # warm-up
            one_request(url, prompts[0][:32], 4)
        raw = RawMooncake(args.prompt_len * pd.decode.internal_state()["disaggregation"]["bytes_per_page"]
                          // args.page_size + (1 << 20))
        xfer = {"pd_gbps": [], "raw_one_range_gbps": [], "raw_same_ranges_gbps": [], "raw_same_ranges_hot_gbps": [],
                "raw_other_process_gbps": [], "backend_other_process_gbps": [], "bytes": [], "ops": []}
        for ids in tqdm(prompts, desc="requests (combined, PD, raw copy: interleaved)"):
            for side, url in (("combined", comb.base_url), ("pd", pd.base_url)):
                before = pd.prefill.internal_state()["disaggregation"]
                ttft, tps = one_request(url, ids, args.max_new_tokens)
                res[side]["ttft"].append(ttft)
                res[side]["tps"].append(tps)
            after = pd.prefill.internal_state()["disaggregation"]
            nbytes = after["bytes_sent"] - before["bytes_sent"]
            ops = after["copy_ops"] - before["copy_ops"]
            xfer["bytes"].append(nbytes)
            xfer["ops"].append(ops)
            xfer["pd_gbps"].append(nbytes / (after["transfer_seconds"] - before["transfer_seconds"]) / 1e9)
            xfer["raw_one_range_gbps"].append(nbytes / raw.write(nbytes, 1) / 1e9)
            xfer["raw_same_ranges_gbps"].append(nbytes / raw.write(nbytes, ops) / 1e9)
            xfer["raw_same_ranges_hot_gbps"].append(nbytes / raw.write(nbytes, ops, hot=True) / 1e9)
            xfer["raw_other_process_gbps"].append(nbytes / raw.write(nbytes, ops, other_process=True) / 1e9)
            xfer["backend_other_process_gbps"].append(
                nbytes / raw.write(nbytes, ops, other_process=True, backend=True) / 1e9)
        raw.close()
    med = {s: {k: statistics.median(v) for k, v in d.items()} for s, d in res.items()}
    out = {
        "setting": vars(args),
        "median": med,
        "ttft_ratio_pd_over_combined": med["pd"]["ttft"] / med["combined"]["ttft"],
        "decode_tps_ratio_pd_over_combined": med["pd"]["tps"] / med["combined"]["tps"],
        "transfer": {k: statistics.median(v) for k, v in xfer.items()},
        "raw": {**res, "transfer": xfer},
    }
    t = out["transfer"]
    t["ratio_vs_raw_one_range"] = t["pd_gbps"] / t["raw_one_range_gbps"]
    t["ratio_vs_raw_same_ranges"] = t["pd_gbps"] / t["raw_same_ranges_gbps"]
    t["ratio_vs_raw_same_ranges_hot"] = t["pd_gbps"] / t["raw_same_ranges_hot_gbps"]
    t["ratio_vs_raw_other_process"] = t["pd_gbps"] / t["raw_other_process_gbps"]
    t["ratio_vs_backend_other_process"] = t["pd_gbps"] / t["backend_other_process_gbps"]
    for ref in ("raw_same_ranges", "raw_other_process", "backend_other_process"):  # paired, request by request
        t[f"median_paired_ratio_vs_{ref}"] = statistics.median(
            p / r for p, r in zip(xfer["pd_gbps"], xfer[f"{ref}_gbps"]))
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    print(json.dumps({k: v for k, v in out.items() if k != "raw"}, indent=1))
    plot(out, args.out.replace(".json", ".png"))


def plot(out: dict, path: str) -> None:
    plt = import_pyplot(path)
    if plt is None:
        return None

    med, t = out["median"], out["transfer"]
    fig, ax = plt.subplots(1, 3, figsize=(14, 3.8), gridspec_kw={"width_ratios": [1, 1, 3]})
    ax[0].bar(["combined", "PD"], [med["combined"]["ttft"] * 1e3, med["pd"]["ttft"] * 1e3])
    ax[0].set_title(f"TTFT (ms), prompt {out['setting']['prompt_len']}")
    ax[1].bar(["combined", "PD"], [med["combined"]["tps"], med["pd"]["tps"]])
    ax[1].set_title("decode tok/s (bs 1)")
    bars = {"PD transfer": "pd_gbps", "raw\n1 range": "raw_one_range_gbps",
            f"raw\n{int(t['ops'])} ranges": "raw_same_ranges_gbps", "raw\ncache-warm": "raw_same_ranges_hot_gbps",
            "raw, idle\nreceiver proc": "raw_other_process_gbps", "backend, idle\nreceiver proc": "backend_other_process_gbps"}
    bars = {k: v for k, v in bars.items() if v in t}  # older results lack the backend reference
    ax[2].bar(list(bars), [t[v] for v in bars.values()], color=["C1"] + ["C0"] * (len(bars) - 1))
    ax[2].set_title("KV transfer GB/s (Mooncake TCP; raw = Mooncake's own sync batch write)")
    fig.tight_layout()
    fig.savefig(path)

if __name__ == "__main__":
    main()
