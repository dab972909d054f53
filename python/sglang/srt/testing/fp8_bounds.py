"""The e4m3 rounding bound on logprobs, shared by the FP8 KV-cache and FP8-weight tests.

e4m3 keeps 3 mantissa bits: a quantised value is within a relative EPS (2^-4) of the original,
and rounding errors are uniform, so to first order a logprob moves by about EPS / sqrt(3) of its
size (x 2: both operands of a product are rounded). Per run: the median |d logprob| must stay
under that bound, at most `flip_fraction` of the positions may exceed the first-order bound
(near-ties that flip the next token), and the greedy argmax must agree at `argmax_agreement` of
the positions or more (a broken scale gives ~1 / vocab).
"""

from __future__ import annotations

import math
import statistics

E4M3_EPS = 2.0**-4


def flat(rows: list[list]) -> list:
    return [x for row in rows for x in row]


def e4m3_logprob_report(ref_lp: list[list[float]], lp: list[list[float]], ref_top: list[list[int]],
                        top: list[list[int]], ref_ids: list[list[int]], ids: list[list[int]],
                        eps: float = E4M3_EPS) -> dict:
    """Statistics of scored logprobs against the reference's on the same sequences, plus the
    free-running greedy agreement of the two runs' own outputs (reported, not bounded)."""
    ref_flat, got = flat(ref_lp), flat(lp)
    diffs = [abs(a - b) for a, b in zip(ref_flat, got)]
    n_new = sum(len(r) for r in ref_ids)
    return {
        "median_diff": statistics.median(diffs),
        "median_bound": 2 * eps / math.sqrt(3) * statistics.median(abs(x) for x in ref_flat),
        "max_diff": max(diffs),
        "over_first_order": sum(d > 2 * eps * abs(x) + 1e-3 for d, x in zip(diffs, ref_flat)) / len(diffs),
        "argmax_agreement": sum(a == b for r, f in zip(ref_top, top) for a, b in zip(r, f)) / len(diffs),
        "free_running_agreement": sum(a == b for r, f in zip(ref_ids, ids) for a, b in zip(r, f)) / n_new,
    }


def assert_within_e4m3_bound(stats: dict, label: str, flip_fraction: float, argmax_agreement: float) -> str:
    """Asserts the bound on `stats` (e4m3_logprob_report); returns the one-line report it printed."""
    report = (f"{label}: median |dlp| {stats['median_diff']:.4f} (bound {stats['median_bound']:.4f}), max "
              f"{stats['max_diff']:.3f}, over first-order bound {stats['over_first_order']:.3f}, argmax agreement "
              f"{stats['argmax_agreement']:.3f}, free-running greedy agreement {stats['free_running_agreement']:.3f}")
    print(report)
    assert stats["median_diff"] <= stats["median_bound"], report
    assert stats["over_first_order"] <= flip_fraction, report
    assert stats["argmax_agreement"] >= argmax_agreement, report
    return report
