"""Analyze KV trace files (`sglang.srt.debug.kv_trace`): name where a HiCache reload went wrong.

    python -m sglang.srt.debug.kv_trace_analyze TRACE [TRACE ...] [--reference RUN] [--json]

1. Pages: every reload of a host slot (fingerprint) + layer + payload is compared with the last
   backup of the same key before it (per file: backup and reload are recorded by one process).
   A differing hash names the payload: "kv" -> main KV, "index_k" -> indexer K. A slot whose
   index K was backed up and whose KV was reloaded but whose index K never was is reported too
   (the upstream bug of an indexer cache not restored on load).
2. Forward (level 3): records are grouped by run label; each run is compared with the reference
   run (`--reference`, default the first run seen) on the keys both hold (block of token ids +
   positions). The first diverging (layer, stage) over all keys is diagnosed:
     topk diverges                    -> indexer K cache
     attn_out diverges, topk equal    -> main KV / page map
     moe_in diverges, attn_out equal  -> residual/MoE
     attn_in diverges (layer L > 0)   -> residual/MoE of the layer before
3. Degenerate tensors: any forward record flagged at record time (non-finite, all zero, zero
   rows, constant, a top-k row selecting nothing).

Exit status: 0 when nothing diverges and nothing is degenerate, 1 otherwise, 2 on bad input,
3 when nothing could be compared (no reload with a backup, no forward key shared by two runs): a
clean result must mean something was checked. Under CP round-robin a block's rows sit on several
ranks; trace with SGLANG_KV_TRACE_BLOCK=1 (one key per token) to compare such runs.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from typing import Iterable

from sglang.srt.debug.kv_trace import FORWARD_STAGES

STAGE_ORDER = {s: i for i, s in enumerate(FORWARD_STAGES)}
PAYLOAD_NAME = {"kv": "main KV", "index_k": "indexer K"}


@dataclass
class Finding:
    kind: str  # page_mismatch | index_not_reloaded | reload_without_backup | forward_divergence | degenerate
    component: str  # what is to blame, in words
    layer: int
    detail: dict = field(default_factory=dict)


@dataclass
class Report:
    page_compared: int = 0
    forward_compared: int = 0
    runs: list[str] = field(default_factory=list)
    reference: str | None = None
    findings: list[Finding] = field(default_factory=list)
    ambiguous_keys: int = 0
    first: dict | None = None  # first forward divergence with its diagnosis

    @property
    def failed(self) -> bool:
        return any(f.kind != "reload_without_backup" for f in self.findings)

    @property
    def nothing_compared(self) -> bool:
        return not self.page_compared and not self.forward_compared

    def to_json(self) -> dict:
        d = asdict(self)
        d["failed"], d["nothing_compared"] = self.failed, self.nothing_compared
        return d


def read_records(paths: Iterable[str]) -> list[tuple[str, dict]]:
    """(file, record) pairs in file order; bad lines raise ValueError naming the file and line."""
    out = []
    for path in paths:
        with open(path) as f:
            for n, line in enumerate(f, 1):
                line = line.strip()
                if not line:
                    continue
                try:
                    out.append((path, json.loads(line)))
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{n}: not a JSON line ({e})") from None
    return out


def _compare_pages(records: list[tuple[str, dict]], report: Report) -> None:
    last_backup: dict[tuple, dict] = {}
    index_backed: set[tuple] = set()
    index_loaded: set[tuple] = set()
    kv_reloaded: set[tuple] = set()
    for path, r in records:
        ev = r.get("ev")
        if ev not in ("backup", "reload", "index_backup", "index_load"):
            continue
        key = (path, r["fp"], r["layer"], r["payload"])
        slot = (path, r["fp"], r["layer"])
        if ev in ("backup", "index_backup"):
            last_backup[key] = r
            if r["payload"] == "index_k":
                index_backed.add(slot)
            continue
        if r["payload"] == "index_k":
            index_loaded.add(slot)
        else:
            kv_reloaded.add(slot)
        b = last_backup.get(key)
        if b is None:
            report.findings.append(Finding("reload_without_backup", PAYLOAD_NAME[r["payload"]], r["layer"],
                                           {"fp": r["fp"], "file": path}))
            continue
        report.page_compared += 1
        if b["hash"] != r["hash"]:
            report.findings.append(Finding(
                "page_mismatch", PAYLOAD_NAME[r["payload"]], r["layer"],
                {"fp": r["fp"], "file": path, "backup_hash": b["hash"], "reload_hash": r["hash"],
                 "backup_nz": b.get("nz"), "reload_nz": r.get("nz")}))
    for path, fp, layer in sorted(index_backed & kv_reloaded - index_loaded, key=lambda s: (s[2], s[1])):
        report.findings.append(Finding("index_not_reloaded", "indexer K", layer, {"fp": fp, "file": path}))


def diagnose(stage: str, layer: int) -> str:
    """The component to blame when (layer, stage) is the first forward divergence."""
    if stage == "topk":
        return "indexer K cache"
    if stage == "attn_out":
        return "main KV / page map"
    if stage == "moe_in":
        return "residual/MoE"
    return "input embedding / token ids" if layer == 0 else "residual/MoE"


def _compare_forward(records: list[tuple[str, dict]], report: Report, reference: str | None) -> None:
    # run -> (layer, stage, key) -> set of hashes seen (more than one: the key is ambiguous in that run)
    runs: dict[str, dict[tuple, set]] = {}
    for _, r in records:
        if r.get("ev") != "fwd":
            continue
        runs.setdefault(r["run"], defaultdict(set))[(r["layer"], r["stage"], r["key"])].add(r["hash"])
        if r.get("flags"):
            report.findings.append(Finding("degenerate", f"{r['stage']} hidden state" if r["stage"] != "topk"
                                           else "top-k indices", r["layer"],
                                           {"run": r["run"], "stage": r["stage"], "key": r["key"],
                                            "flags": r["flags"]}))
    report.runs = list(runs)
    if len(runs) < 2:
        return
    if reference is not None and reference not in runs:
        raise ValueError(f"reference run {reference!r} not in the traces (runs: {list(runs)})")
    ref_name = reference or report.runs[0]
    report.reference = ref_name
    ref = runs[ref_name]
    order = lambda k: (k[0], STAGE_ORDER.get(k[1], len(STAGE_ORDER)), k[2])  # noqa: E731
    for name, run in runs.items():
        if name == ref_name:
            continue
        first = None
        for k in sorted(set(run) & set(ref), key=order):
            a, b = ref[k], run[k]
            if len(a) > 1 or len(b) > 1:
                report.ambiguous_keys += 1  # same tokens at the same positions with different context
                continue
            report.forward_compared += 1
            if a != b:
                layer, stage, key = k
                report.findings.append(Finding("forward_divergence", diagnose(stage, layer), layer,
                                               {"run": name, "stage": stage, "key": key}))
                if first is None or order(k) < order((first["layer"], first["stage"], first["key"])):
                    first = {"run": name, "reference": ref_name, "layer": layer, "stage": stage, "key": key,
                             "diagnosis": diagnose(stage, layer)}
        if first is not None and (report.first is None or
                                  (first["layer"], STAGE_ORDER[first["stage"]]) <
                                  (report.first["layer"], STAGE_ORDER[report.first["stage"]])):
            report.first = first


def analyze(paths: list[str], reference: str | None = None) -> Report:
    records = read_records(paths)
    report = Report()
    _compare_pages(records, report)
    _compare_forward(records, report, reference)
    return report


def format_report(report: Report) -> str:
    lines = [f"pages compared: {report.page_compared}; forward records compared: {report.forward_compared}"
             + (f" (runs {report.runs}, reference {report.reference!r})" if report.reference else
                f" (runs {report.runs})")]
    pages = [f for f in report.findings if f.kind == "page_mismatch"]
    if pages:
        first = min(pages, key=lambda f: (f.layer, f.component))
        lines.append(f"FIRST PAGE MISMATCH: {first.component} of layer {first.layer} "
                     f"(host slot {first.detail['fp']}): reload differs from backup "
                     f"[{len(pages)} page(s) in all]")
        by = defaultdict(int)
        for f in pages:
            by[(f.component, f.layer)] += 1
        lines += [f"  {comp} layer {layer}: {n} page(s)" for (comp, layer), n in sorted(by.items(), key=lambda x: x[0][1])]
    for f in report.findings:
        if f.kind == "index_not_reloaded":
            lines.append(f"INDEXER K NOT RELOADED: layer {f.layer} host slot {f.detail['fp']} "
                         "(backed up, KV reloaded, index K never loaded)")
    if report.first is not None:
        fd = report.first
        n = sum(f.kind == "forward_divergence" for f in report.findings)
        lines.append(f"FIRST FORWARD DIVERGENCE: layer {fd['layer']} stage {fd['stage']} "
                     f"(run {fd['run']!r} vs {fd['reference']!r}, key {fd['key']}) -> {fd['diagnosis']} "
                     f"[{n} diverging record(s) in all]")
    degenerate = [f for f in report.findings if f.kind == "degenerate"]
    for f in degenerate[:20]:
        lines.append(f"DEGENERATE: {f.component} at layer {f.layer} (run {f.detail['run']!r}, "
                     f"key {f.detail['key']}): {', '.join(f.detail['flags'])}")
    if len(degenerate) > 20:
        lines.append(f"  ... {len(degenerate) - 20} more degenerate record(s)")
    orphans = sum(f.kind == "reload_without_backup" for f in report.findings)
    if orphans:
        lines.append(f"note: {orphans} reload record(s) without a backup in the same file (not compared)")
    if report.ambiguous_keys:
        lines.append(f"note: {report.ambiguous_keys} forward key(s) ambiguous within a run (not compared)")
    if report.failed:
        lines.append("RESULT: DIVERGENCE FOUND")
    elif report.nothing_compared:
        lines.append("RESULT: nothing compared (no reload with a backup, no forward key shared by two runs)")
    else:
        lines.append("RESULT: no divergence")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m sglang.srt.debug.kv_trace_analyze", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("traces", nargs="+", help="JSONL trace files (SGLANG_KV_TRACE_PATH), e.g. one per rank")
    ap.add_argument("--reference", help="run label the other runs are compared with (default: the first run)")
    ap.add_argument("--json", action="store_true", help="print the report as JSON")
    args = ap.parse_args(argv)
    try:
        report = analyze(args.traces, args.reference)
    except (OSError, ValueError, KeyError) as e:
        print(f"kv_trace_analyze: {e}", file=sys.stderr)
        return 2
    print(json.dumps(report.to_json(), indent=2) if args.json else format_report(report))
    return 1 if report.failed else 3 if report.nothing_compared else 0


if __name__ == "__main__":
    sys.exit(main())
