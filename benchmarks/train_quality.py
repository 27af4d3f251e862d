"""Training-quality benchmark: train presets and print held-out BLEU and wall time.

    python benchmarks/train_quality.py                      # dates-transformer, dates-bahdanau
    python benchmarks/train_quality.py --presets ding-transformer ding-bahdanau

Targets (2 CPU cores): dates >= 98 BLEU within 5 minutes per model; Ding (<= 30 minutes per model)
Transformer >= 20 BLEU and above Bahdanau. Not a test: it prints figures for benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from training.config import TrainConfig
from training.presets import PRESETS
from training.train import train


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--presets", nargs="+", default=["dates-transformer", "dates-bahdanau"],
                        choices=sorted(PRESETS))
    parser.add_argument("--out", default="runs/bench", help="parent directory of the runs")
    parser.add_argument("--max-minutes", type=float, help="override the presets' time limit")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args()

    rows = []
    for name in args.presets:
        settings = dict(PRESETS[name])
        if args.max_minutes:
            settings["max_minutes"] = args.max_minutes
        cfg = TrainConfig(**settings, out=str(Path(args.out) / name), force=True, progress=not args.no_progress)
        start = time.monotonic()
        result = train(cfg)
        rows.append((name, result.steps, time.monotonic() - start, result.best_valid_bleu, result.test_bleu))

    print()
    print(f"| {'preset':<18} | {'steps':>6} | {'wall time':>9} | {'valid BLEU':>10} | {'test BLEU':>9} |")
    print(f"|{'-' * 20}|{'-' * 8}|{'-' * 11}|{'-' * 12}|{'-' * 11}|")
    for name, steps, seconds, valid, test in rows:
        print(f"| {name:<18} | {steps:>6} | {seconds / 60:>7.1f} m | {valid:>10.2f} | {test:>9.2f} |")


if __name__ == "__main__":
    main()
