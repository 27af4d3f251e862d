"""How often a running decode's plain steps are cut, and the host's work each cut costs.

    python benchmarks/decode_cuts.py --model-version <repository>/demo-transformer/1
    python benchmarks/decode_cuts.py --model-version ... --device-state   # the path CUDA versions take

A decode runs its quiet steps in plain runs (``RunningDecode.step(until_leave=True)``,
:meth:`server.engine.decode.RunningDecode._plain`). A step in which a sentence ends cuts the run. The general
step then selects that step, moves the rows of the sentences that stay (``_advance``), lays the rows out again,
and the next plain run is set up. This decodes one static batch of ``--sentences`` of the benchmark's sentences
(``server_load.py``'s mix of dates, numbers and words) with ``--beam``, ``--repeats`` times after a warm-up, and
prints per call:

* the steps, and the ``step()`` calls they took (each call after the first follows a cut);
* the time of those calls, split into the time inside ONNX Runtime's runs (step graphs, and the row ``Gather``
  sessions of a state kept on the device) and the host's work outside them;
* the median host time of one ``step()`` call, and the host time per step.

``--hold-ended`` holds the row of a sentence that ended until the run ends, as a static batch does on a device
(:attr:`server.engine.decode.RunningDecode.hold_ended`), instead of cutting the run there, and
``--no-hold-ended`` cuts it there on a device too (default: as the engine decides, held on a device only);
``--emulate-step-ms`` runs the step graphs on the emulated device of ``nmt bench batching`` (every step at least
that long, whatever its rows: a held row then costs nothing, as on a GPU); ``--provider cuda`` runs on a GPU:

    python benchmarks/decode_cuts.py --model-version ... --emulate-step-ms 5 [--hold-ended]
    python benchmarks/decode_cuts.py --model-version ... --provider cuda [--no-hold-ended]

``--device-state`` loads the version as CUDA versions load (:class:`server.engine.device_step_model.DeviceStepModel`:
encoder outputs and KV cache as ``OrtValue`` s, rows moved by ``Gather`` sessions), here on the CPU: the host's
Python is the same on a GPU, the device's runs are not.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import onnxruntime as ort

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a script: this checkout's packages
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))  # the benchmarks' shared modules

from bench_common import (
    host,  # noqa: E402
    sentences,  # noqa: E402
)
from emulated_device.sitecustomize import emulate  # noqa: E402

from server.engine import decode  # noqa: E402
from server.engine.engine import Engine  # noqa: E402
from server.types import DecodingOptions, SentenceRequest  # noqa: E402


class Clock:
    """Seconds inside ONNX Runtime's runs, and each ``RunningDecode.step`` call: (steps, seconds, seconds in runs)."""

    def __init__(self) -> None:
        self.inside = 0.0
        self.calls: list[tuple[int, float, float]] = []
        for method in ("run", "run_with_iobinding"):
            setattr(ort.InferenceSession, method, self._timed(getattr(ort.InferenceSession, method)))
        step = decode.RunningDecode.step

        def timed_step(running: decode.RunningDecode, *args, **kwargs):
            steps, inside, start = running.steps_run, self.inside, time.perf_counter()
            left = step(running, *args, **kwargs)
            self.calls.append((running.steps_run - steps, time.perf_counter() - start, self.inside - inside))
            return left

        decode.RunningDecode.step = timed_step

    def _timed(self, run):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return run(*args, **kwargs)
            finally:
                self.inside += time.perf_counter() - start
        return timed


def hold_ended(cls: type, hold: bool) -> None:
    """Every decode of ``cls`` (:class:`server.engine.decode.RunningDecode`) holds its ended rows, or cuts."""
    init = cls.__init__

    def holding(running: decode.RunningDecode, *args, **kwargs) -> None:
        init(running, *args, **{**kwargs, "hold_ended": hold})

    cls.__init__ = holding


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--model-version", required=True, type=Path, help="a model version directory")
    parser.add_argument("--sentences", type=int, default=128)
    parser.add_argument("--beam", type=int, default=1)
    parser.add_argument("--device-state", action="store_true",
                        help="load as CUDA versions load (DeviceStepModel), on the CPU")
    parser.add_argument("--hold-ended", action=argparse.BooleanOptionalAction, default=None,
                        help="hold an ended sentence's row until the run ends, or cut the run there (default: "
                        "as the engine decides: held on a device)")
    parser.add_argument("--provider", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--emulate-step-ms", type=float, default=0.0,
                        help="every step graph run takes at least this long (benchmarks/emulated_device)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    if args.emulate_step_ms:
        emulate(args.emulate_step_ms, 0.0)
    if args.hold_ended is not None:
        hold_ended(decode.RunningDecode, args.hold_ended)
    engine = Engine.load(args.model_version, provider=args.provider, intra_op_threads=args.threads,
                         device_state=args.device_state or None)
    options = DecodingOptions(beam_size=args.beam)
    requests = [SentenceRequest(engine.tokenize(text), options, text=text) for text in sentences(args.sentences, 1)]
    clock = Clock()
    engine.translate_batch(requests)  # warm-up
    path = "CUDA" if args.provider == "cuda" else "DeviceStepModel (device_state) on the CPU" if args.device_state \
        else "host arrays"
    print(f"{host()}; ONNX Runtime {ort.__version__}, {args.threads} threads; {args.model_version}, {path}")
    print(f"one batch of {args.sentences} sentences, beam {args.beam}"
          f"{'' if args.hold_ended is None else ', ended rows held' if args.hold_ended else ', cut at every end'}"
          f"{f', steps of at least {args.emulate_step_ms:g} ms (emulated device)' if args.emulate_step_ms else ''}")
    print("| call | steps | step() calls | ms in step() | ms in ONNX Runtime | host ms | host us a step() call "
          "(median) | host us a step |")
    print("|---|---|---|---|---|---|---|---|")
    for repeat in range(args.repeats):
        clock.calls.clear()
        engine.translate_batch(requests)
        steps = sum(c[0] for c in clock.calls)
        total, inside = sum(c[1] for c in clock.calls), sum(c[2] for c in clock.calls)
        host_each = [c[1] - c[2] for c in clock.calls]
        print(f"| {repeat + 1} | {steps} | {len(clock.calls)} | {total * 1e3:.1f} | {inside * 1e3:.1f} | "
              f"{(total - inside) * 1e3:.1f} | {statistics.median(host_each) * 1e6:.0f} | "
              f"{(total - inside) / max(steps, 1) * 1e6:.0f} |", flush=True)


if __name__ == "__main__":
    main()
