"""A/B of the bare engine: two (checkout, model version) pairs, sentences/s and tokens/s per batch size
and beam, medians and the B/A ratio.

    python benchmarks/engine_ab.py --a /work/main /work/main/models/demo-transformer/1 \\
        --b . /tmp/models/demo-transformer/1 --texts /work/main/runs/demo-transformer/test.tsv
    python benchmarks/engine_ab.py --a . OLD_VERSION --b . NEW_VERSION --ids 8000 --max-length 24

Sources are the first column of ``--texts`` (tokenized by each version), or with ``--ids VOCAB`` random
20-token id sequences (for engine_throughput.py's random-weight models, whose EOS is suppressed so every
output has ``--max-length`` tokens). Engines load as ``nmt serve`` does on the CPU (2 intra-op threads,
spinning within a run); outputs must agree between A and B.

When A and B share a checkout (one version of this project's engine, e.g. a version exported before a
format change against one exported after), both load into one process and alternate every
``--window`` seconds, ``--rounds`` times per cell: on a shared host the load drifts less within a
window pair than between processes. Otherwise each worker is its own process (its checkout first on
``sys.path``), alternating ``--repeats`` times.

With ``--arrivals GAP`` a cell is a continuous decode instead of one static batch: its ``batch``
sentences arrive over the decoding steps (Poisson gaps of mean GAP steps) and join one running decode
(:class:`server.engine.decode.RunningDecode`, as ``--batching continuous`` drives it, up to ``--max-rows``
rows), each with its own maximum length drawn from 4..``--max-length``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a script: this checkout's packages
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))  # the benchmarks' shared modules


def worker(checkout: str, versions: list[str], job_path: str) -> None:
    """Measure ``versions`` with ``checkout``'s engine (alternating when there are two); prints one JSON line."""
    sys.path.insert(0, checkout)
    import server.engine.engine
    from server.engine.engine import Engine
    from server.types import DecodingOptions, SentenceRequest

    job = json.loads(Path(job_path).read_text())
    engines = [Engine.load(v, provider="cpu", intra_op_threads=job["threads"], inter_op_threads=1) for v in versions]
    rng = np.random.default_rng(0)
    count = max(job["batches"])
    arrivals = np.cumsum(rng.poisson(job["arrivals"] or 0.0, count))
    lengths = ([job["max_length"]] * count if job["arrivals"] is None
               else rng.integers(4, job["max_length"] + 1, count))

    def decode(engine: Engine, batch: int, beam: int) -> list[list[int]]:
        options = [DecodingOptions(beam_size=beam, max_length=int(n)) for n in lengths[:batch]]
        if job["ids"] is not None:
            requests = [SentenceRequest(ids, o) for ids, o in zip(job["ids"][:batch], options, strict=True)]
        else:
            requests = [SentenceRequest(engine.tokenize(text), o, text=text)
                        for text, o in zip(job["texts"][:batch], options, strict=True)]
        if job["arrivals"] is None:
            return [t.hypotheses[0].token_ids for t in engine.translate_batch(requests).translations]
        return continuous(engine, requests, arrivals[:batch], job["max_rows"])

    report: dict = {"rates": [{} for _ in engines], "outputs": [{} for _ in engines],
                    "engine": server.engine.engine.__file__}
    for beam in job["beams"]:
        for batch in job["batches"]:
            key = f"{batch}x{beam}"
            for i, engine in enumerate(engines):
                report["outputs"][i][key] = decode(engine, batch, beam)  # also the warm-up
                report["rates"][i][key] = []
            for _ in range(job["rounds"]):
                for i, engine in enumerate(engines):
                    calls, tokens, start = 0, 0, time.perf_counter()
                    while (elapsed := time.perf_counter() - start) < job["window"] or not calls:
                        tokens += sum(len(ids) for ids in decode(engine, batch, beam))
                        calls += 1
                    report["rates"][i][key].append((calls * batch / elapsed, tokens / elapsed))
    print(json.dumps(report))


def continuous(engine, requests: list, arrivals: np.ndarray, max_rows: int) -> list[list[int]]:
    """Each request joins one running decode at its arrival step (or once its beam fits in ``max_rows``)."""
    from server.engine.decode import RunningDecode

    decode = RunningDecode(engine.model, start_id=engine.start_id, eos_id=engine.eos_id)
    waiting, outputs, step = list(range(len(requests))), {}, 0
    while waiting or decode.rows:
        ready, reserved = [], decode.reserved_rows
        while waiting and arrivals[waiting[0]] <= step:
            beam = requests[waiting[0]].options.beam_size
            if reserved + beam > max_rows:
                break
            reserved += beam
            ready.append(waiting.pop(0))
        if ready:
            encoded, sentences, _ = engine.encode([requests[i] for i in ready])
            decode.admit(encoded, sentences, ready)
        if decode.rows:
            outputs |= {i: result.hypotheses[0].tokens for i, result in decode.step()}
        step += 1
    return [[int(t) for t in outputs[i]] for i in range(len(requests))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--a", nargs=2, metavar=("CHECKOUT", "VERSION_DIR"), required=True)
    parser.add_argument("--b", nargs=2, metavar=("CHECKOUT", "VERSION_DIR"), required=True)
    sources = parser.add_mutually_exclusive_group(required=True)
    sources.add_argument("--texts", type=Path, help="TSV whose first column holds source texts")
    sources.add_argument("--ids", type=int, metavar="VOCAB", help="random 20-token sources of ids 2..VOCAB-2")
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 8, 32, 128])
    parser.add_argument("--beams", nargs="+", type=int, default=[1, 4])
    parser.add_argument("--max-length", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3, help="worker processes per side (different checkouts)")
    parser.add_argument("--rounds", type=int, default=6, help="windows per side and cell (one checkout)")
    parser.add_argument("--window", type=float, default=0.4, help="seconds per window (one checkout)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--arrivals", type=float, metavar="GAP",
                        help="a continuous decode per cell: sentences arrive with mean GAP steps between them")
    parser.add_argument("--max-rows", type=int, default=128, help="rows of the continuous decode (--arrivals)")
    parser.add_argument("--worker", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker[0], args.worker[1:-1], args.worker[-1])
        return
    from engine_throughput import host
    from engine_throughput import sources as random_sources

    count = max(args.batches)
    texts = ([line.split("\t")[0] for line in args.texts.read_text(encoding="utf-8").splitlines() if line.strip()]
             if args.texts else [])
    job = {"texts": texts[:count], "ids": random_sources(count, args.ids) if args.ids else None,
           "batches": args.batches, "beams": args.beams, "max_length": args.max_length, "threads": args.threads,
           "arrivals": args.arrivals, "max_rows": args.max_rows}
    same = Path(args.a[0]).resolve() == Path(args.b[0]).resolve()
    job |= {"rounds": args.rounds, "window": args.window} if same else {"rounds": 1, "window": 1.5}
    job_path = Path(f"/tmp/engine_ab_job_{time.time_ns()}.json")
    job_path.write_text(json.dumps(job))
    print(f"host: {host()}; A = {' '.join(args.a)}; B = {' '.join(args.b)}; "
          + ("one process, alternating windows" if same else "one process per run, alternating"), flush=True)
    runs: dict[str, list[dict]] = {"A": [], "B": []}
    plan = [("A", "B")] if same else [(label,) for r in range(args.repeats) for label in ("AB" if r % 2 else "BA")]
    pairs = {"A": args.a, "B": args.b}
    for labels in plan:
        checkout = str(Path(pairs[labels[0]][0]).resolve())
        versions = [str(Path(pairs[label][1]).resolve()) for label in labels]
        done = subprocess.run([sys.executable, __file__, "--a", *args.a, "--b", *args.b, "--ids", "0",
                               "--worker", checkout, *versions, str(job_path)], capture_output=True, text=True)
        if done.returncode:
            raise SystemExit(f"worker {labels} failed:\n{done.stderr[-3000:]}")
        report = json.loads(done.stdout.strip().splitlines()[-1])
        for i, label in enumerate(labels):
            runs[label].append({key: report[key][i] for key in ("rates", "outputs")} | {"engine": report["engine"]})
        time.sleep(0.5)
    job_path.unlink()
    print("engines: " + ", ".join(f"{label} {runs[label][0]['engine']}" for label in runs))
    print("\n| beam | batch | A sentences/s | B sentences/s | A tokens/s | B tokens/s | B/A | outputs agree |\n"
          "|---|---|---|---|---|---|---|---|")
    for beam in args.beams:
        for batch in args.batches:
            key = f"{batch}x{beam}"
            a, b = ([rate for run in runs[label] for rate in run["rates"][key]] for label in ("A", "B"))
            agree = runs["A"][0]["outputs"][key] == runs["B"][0]["outputs"][key]
            median = {label: [statistics.median(r[i] for r in rates) for i in (0, 1)] for label, rates in
                      (("A", a), ("B", b))}
            spread = {label: f"{min(r[0] for r in rates):,.0f}-{max(r[0] for r in rates):,.0f}"
                      for label, rates in (("A", a), ("B", b))}
            print(f"| {beam} | {batch} | {median['A'][0]:,.0f} ({spread['A']}) | {median['B'][0]:,.0f} ({spread['B']}) "
                  f"| {median['A'][1]:,.0f} | {median['B'][1]:,.0f} | {median['B'][0] / median['A'][0]:.2f}x | "
                  f"{'yes' if agree else 'NO'} |")


if __name__ == "__main__":
    main()
