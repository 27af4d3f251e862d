"""A/B of the bare engine: two (checkout, model version) pairs on real sentences, each run in its own
process, alternating; sentences/s per batch size and beam, medians of the repeats and the B/A ratio.

    python benchmarks/engine_ab.py --a /work/main /work/main/models/demo-transformer/1 \\
        --b . /tmp/models/demo-transformer/1 --texts /work/main/runs/demo-transformer/test.tsv

Each worker puts its checkout first on ``sys.path`` before importing the engine, so A and B may be
different versions of this project (main against a branch) on versions exported by each one's own
exporter from the same weights. Workers load the engine as ``nmt serve`` does on the CPU (2 intra-op
threads, spinning within a run), translate the first ``batch`` source texts (the first column of
``--texts``) once to warm up, then back to back for ``--seconds``; outputs must agree between A and B.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def worker(checkout: str, version_dir: str, job_path: str) -> None:
    """Measure one (checkout, version) pair; prints one JSON line."""
    sys.path.insert(0, checkout)
    from server.engine import Engine
    from server.types import DecodingOptions

    job = json.loads(Path(job_path).read_text())
    engine = Engine.load(version_dir, provider="cpu", intra_op_threads=job["threads"], inter_op_threads=1)
    import server.engine

    report: dict = {"rates": {}, "outputs": {}, "engine": server.engine.__file__}
    for beam in job["beams"]:
        options = DecodingOptions(beam_size=beam, max_length=job["max_length"])
        for batch in job["batches"]:
            texts = job["texts"][:batch]
            outputs = [t.hypotheses[0].text for t in engine.translate(texts, options)]
            calls, start = 0, time.perf_counter()
            while (elapsed := time.perf_counter() - start) < job["seconds"] or not calls:
                engine.translate(texts, options)
                calls += 1
            report["rates"][f"{batch}x{beam}"] = calls * batch / elapsed
            report["outputs"][f"{batch}x{beam}"] = outputs
    print(json.dumps(report))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--a", nargs=2, metavar=("CHECKOUT", "VERSION_DIR"), required=True)
    parser.add_argument("--b", nargs=2, metavar=("CHECKOUT", "VERSION_DIR"), required=True)
    parser.add_argument("--texts", type=Path, required=True, help="TSV whose first column holds source texts")
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 8, 32, 128])
    parser.add_argument("--beams", nargs="+", type=int, default=[1, 4])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=1.5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--worker", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(*args.worker)
        return
    from engine_throughput import host

    texts = [line.split("\t")[0] for line in args.texts.read_text(encoding="utf-8").splitlines() if line.strip()]
    job = {"texts": texts[: max(args.batches)], "batches": args.batches, "beams": args.beams,
           "seconds": args.seconds, "threads": args.threads, "max_length": 256}
    job_path = Path(f"/tmp/engine_ab_job_{time.time_ns()}.json")
    job_path.write_text(json.dumps(job))
    print(f"host: {host()}; A = {' '.join(args.a)}; B = {' '.join(args.b)}", flush=True)
    runs: dict[str, list[dict]] = {"A": [], "B": []}
    pairs = {"A": args.a, "B": args.b}
    for repeat in range(args.repeats):
        for label in ("A", "B") if repeat % 2 == 0 else ("B", "A"):
            checkout, version = (str(Path(p).resolve()) for p in pairs[label])
            done = subprocess.run([sys.executable, __file__, "--a", *args.a, "--b", *args.b, "--texts", str(args.texts),
                                   "--worker", checkout, version, str(job_path)], capture_output=True, text=True)
            if done.returncode:
                raise SystemExit(f"worker {label} failed:\n{done.stderr[-3000:]}")
            runs[label].append(json.loads(done.stdout.strip().splitlines()[-1]))
            time.sleep(1.0)
    job_path.unlink()
    print("engines: " + ", ".join(f"{label} {runs[label][0]['engine']}" for label in runs))
    print("\n| beam | batch | A sentences/s | B sentences/s | B/A | outputs agree |\n|---|---|---|---|---|---|")
    for beam in args.beams:
        for batch in args.batches:
            key = f"{batch}x{beam}"
            a, b = ([run["rates"][key] for run in runs[label]] for label in ("A", "B"))
            agree = runs["A"][0]["outputs"][key] == runs["B"][0]["outputs"][key]
            print(f"| {beam} | {batch} | {statistics.median(a):,.0f} ({min(a):,.0f}-{max(a):,.0f}) | "
                  f"{statistics.median(b):,.0f} ({min(b):,.0f}-{max(b):,.0f}) | "
                  f"{statistics.median(b) / statistics.median(a):.2f}x | {'yes' if agree else 'NO'} |")


if __name__ == "__main__":
    main()
