"""Peak memory and time of the chunked logprob passes against the textbook `log_softmax(logits.float()).gather`.

    python -m bench.logprobs            # V in {49,152, 151,936} x B*T in {2,048 .. 16,384}
    python -m bench.logprobs --quick    # smoke run: the smallest size only

Each measurement runs in a fresh subprocess. There, after the inputs exist, the kernel's peak-RSS counter is
reset (`echo 5 > /proc/self/clear_refs`), the pass runs, and the pass's peak is VmHWM minus the RSS before
it: every byte the pass touched (torch's CPU allocator returns large blocks to the OS, so RSS follows
tensor allocations), inputs excluded, counted once. The same process then reports how far the values are
from the naive ones. Cases whose naive pass would not fit in --max-gib are skipped and say so.

Four passes over N = B*T rows:
  naive            log_softmax(logits.float()).gather, given logits [N, V]        (the textbook reference)
  chunked          the same log_softmax on the same logits, a chunk of rows at a time
  naive_hidden     logits = hidden @ W.T, then naive: what a model forward + loss does (H = 576, SmolLM2)
  fused_hidden     models.logprobs.LogprobsFromHidden: what completion_logprobs does, no [N, V] tensor
"""
from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time

HIDDEN = 576
VOCABS = (49152, 151936)
ROWS = (2048, 4096, 8192, 16384)


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        return int(re.search(rf"{field}:\s+(\d+)", status.read()).group(1))


def _measure(method: str, vocab: int, rows: int, chunk_size: int, compare: bool) -> dict:
    """Runs inside the subprocess: build inputs, reset the peak, run the pass, report."""
    import torch

    from models.logprobs import LogprobsFromHidden

    torch.set_num_threads(2)
    generator = torch.Generator().manual_seed(0)
    labels = torch.randint(0, vocab, (rows,), generator=generator)
    uses_hidden = method.endswith("hidden")
    if uses_hidden:
        hidden = torch.randn(rows, HIDDEN, generator=generator)
        weight = torch.randn(vocab, HIDDEN, generator=generator) * 0.05
    else:
        logits = torch.empty(rows, vocab)
        for start in range(0, rows, 1024):  # fill in blocks: no full-size temporary before the reset
            logits[start : start + 1024] = torch.randn(min(1024, rows - start), vocab, generator=generator) * 3

    def run():
        if method == "naive":
            return torch.log_softmax(logits.float(), dim=-1).gather(-1, labels[:, None]).squeeze(-1)
        if method == "chunked":
            values = torch.empty(rows)
            for start in range(0, rows, chunk_size):
                chunk = slice(start, start + chunk_size)
                values[chunk] = torch.log_softmax(logits[chunk].float(), dim=-1).gather(-1, labels[chunk, None])[:, 0]
            return values
        if method == "naive_hidden":
            return torch.log_softmax((hidden @ weight.t()).float(), dim=-1).gather(-1, labels[:, None]).squeeze(-1)
        return LogprobsFromHidden.apply(hidden, weight, None, labels, 1.0, chunk_size, False)[0]

    with open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")
    before_kib = _status_kib("VmRSS")
    with torch.no_grad():
        started = time.perf_counter()
        values = run()
        seconds = time.perf_counter() - started
    peak_kib = _status_kib("VmHWM")
    result = {"peak_extra_bytes": (peak_kib - before_kib) * 1024, "inputs_bytes_rss": before_kib * 1024, "seconds": seconds}
    if compare:
        reference_method = "naive_hidden" if uses_hidden else "naive"
        with torch.no_grad():
            if reference_method == "naive":
                reference = torch.log_softmax(logits.float(), dim=-1).gather(-1, labels[:, None]).squeeze(-1)
            else:
                reference = torch.log_softmax((hidden @ weight.t()).float(), dim=-1).gather(-1, labels[:, None]).squeeze(-1)
        result["max_abs_diff"] = (values - reference).abs().max().item()
    return result


def _estimated_naive_bytes(vocab: int, rows: int) -> int:
    return 2 * 4 * vocab * rows  # logits [N, V] fp32 + log_softmax output [N, V] fp32


def _in_subprocess(method: str, vocab: int, rows: int, chunk_size: int, compare: bool) -> dict:
    command = [sys.executable, "-m", "bench.logprobs", "--child", method, str(vocab), str(rows), str(chunk_size), str(int(compare))]
    finished = subprocess.run(command, capture_output=True, text=True)
    if finished.returncode != 0:
        return {"error": finished.stderr.strip().splitlines()[-1] if finished.stderr.strip() else f"exit {finished.returncode}"}
    return json.loads(finished.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="only V = 49,152 and B*T = 2,048")
    parser.add_argument("--chunk-size", type=int, default=512)
    parser.add_argument("--max-gib", type=float, default=8.0, help="skip a case whose naive pass needs more than this")
    parser.add_argument("--json", help="also write the results to this file")
    parser.add_argument("--child", nargs=5, help=argparse.SUPPRESS)
    arguments = parser.parse_args(argv)
    if arguments.child:
        method, vocab, rows, chunk_size, compare = arguments.child
        print(json.dumps(_measure(method, int(vocab), int(rows), int(chunk_size), compare == "1")))
        return

    vocabs, rows_list = ((VOCABS[0],), (ROWS[0],)) if arguments.quick else (VOCABS, ROWS)
    gib = 1024**3
    print(f"chunk {arguments.chunk_size} rows; peak = extra resident memory of the pass, inputs excluded")
    print(f"{'V':>7} {'B*T':>6} {'pass':>13} {'peak GiB':>9} {'seconds':>8} {'vs naive':>9} {'max|diff|':>10}")
    results = []
    for vocab in vocabs:
        for rows in rows_list:
            fits = _estimated_naive_bytes(vocab, rows) <= arguments.max_gib * gib
            for naive_method, lean_method in (("naive", "chunked"), ("naive_hidden", "fused_hidden")):
                lean_fits = lean_method == "fused_hidden" or 4 * vocab * rows <= arguments.max_gib * gib
                naive = _in_subprocess(naive_method, vocab, rows, arguments.chunk_size, False) if fits else {"skipped": True}
                lean = _in_subprocess(lean_method, vocab, rows, arguments.chunk_size, fits) if lean_fits else {"skipped": True}
                for method, result in ((naive_method, naive), (lean_method, lean)):
                    results.append({"vocab": vocab, "rows": rows, "method": method, **result})
                    if result.get("skipped") or "error" in result:
                        reason = result.get("error", f"skipped: needs about {_estimated_naive_bytes(vocab, rows) / gib:.1f} GiB > --max-gib")
                        print(f"{vocab:>7} {rows:>6} {method:>13}  {reason}")
                        continue
                    ratio = ""
                    if method == lean_method and "peak_extra_bytes" in naive:
                        ratio = f"{result['peak_extra_bytes'] / naive['peak_extra_bytes']:.3f}x"
                    diff = f"{result['max_abs_diff']:.2e}" if "max_abs_diff" in result else ""
                    print(f"{vocab:>7} {rows:>6} {method:>13} {result['peak_extra_bytes'] / gib:>9.3f} "
                          f"{result['seconds']:>8.2f} {ratio:>9} {diff:>10}", flush=True)
    if arguments.json:
        with open(arguments.json, "w") as handle:
            json.dump(results, handle, indent=1)


if __name__ == "__main__":
    main()
