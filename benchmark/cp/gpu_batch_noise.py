"""GPU noise floor for the CP equivalence tolerance: at cp = 1, the same prompts (those of
test_context_parallel) batched vs one at a time. cuBLAS picks kernels by the number of rows, so a
row's logits differ in the last bits with its batch; CP changes each rank's rows the same way.

    python benchmark/cp/gpu_batch_noise.py   # on a GPU machine; writes $OUT or /tmp batch_noise.json
"""
import json
import os

import torch

from sglang.srt.model_loader.builtin import resolve_model_path
from sglang.srt.testing.multi_rank import Case, run_case

g = torch.Generator().manual_seed(0)
prompts = [torch.randint(3, 250, (n,), generator=g).tolist() for n in (37, 70, 5, 64, 130)]
out = {}
for model in ("tiny-deepseek-v32",):
    for ps in (1, 64):
        sa = dict(model_path=resolve_model_path("builtin:" + model), page_size=ps, chunked_prefill_size=-1, device="cuda")
        batched = run_case(Case("b", sa, prompts, 6, return_logprob=True), 1)
        worst, flips = 0.0, 0
        for i, p in enumerate(prompts):
            alone = run_case(Case("a", sa, [p], 6, return_logprob=True), 1)["p0"]
            b = batched[f"p{i}"]
            flips += alone["ids"] != b["ids"]
            worst = max([worst] + [abs(x - y) for x, y in zip(alone["logprobs"], b["logprobs"])])
        out[f"{model}/p{ps}"] = {"max_logprob_diff_batched_vs_alone": worst, "token_flips": flips}
        print(model, ps, out[f"{model}/p{ps}"], flush=True)
json.dump(out, open(os.path.join(os.environ.get("OUT", "/tmp"), "batch_noise.json"), "w"), indent=1)
