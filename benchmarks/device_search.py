"""Beam search's selection on the device against the host's, on the engine that keeps its state on the device.

    python benchmarks/device_search.py --size SMALL --batches 1 8 32 --beams 4
    python benchmarks/device_search.py --size SMALL --precision fp16 --provider cuda   # on a GPU

One random-weight Marian model of ``--size`` (``engine_throughput.py``'s; EOS suppressed, so every output has
``--max-length`` tokens) exported in ``--precision`` and loaded as CUDA versions load
(:class:`server.engine.device_step_model.DeviceStepModel`: encoder outputs and KV cache as ``OrtValue`` s, rows
moved by ``Gather`` sessions; on the CPU forced with ``device_state=True``). Each cell decodes one static batch
two ways, alternating call by call in this process (``--repeats`` calls each, medians):

* ``host``: each step's best tokens come to the host, which selects the hypotheses
  (:func:`server.engine.beam_select.select_beam`) and sends the rows back for the cache's ``Gather``;
* ``device``: the selection graph (:mod:`server.engine.device_search`) chooses on the device; the host reads one
  byte a sentence per step.

Per cell: tokens/s, milliseconds a step, the host's bytes read from the device per step (every
``OrtValue.numpy()`` of the decode, counted, over the whole call) and, for the device's selection, per quiet step
(one byte a sentence), and the ratio device/host; outputs must agree.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from onnxruntime import OrtValue

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine_throughput import SIZES, export_project, host, marian_model, sources  # noqa: E402

_read = [0]  # bytes brought to the host by OrtValue.numpy() since the counter was reset
_quiet = [0, 0]  # quiet steps of the device's selection and the bytes they read


def _counting_steps(step):
    def counted(self):
        before = self.bytes_read
        done = step(self)
        if not done:
            _quiet[0] += 1
            _quiet[1] += self.bytes_read - before
        return done
    return counted


def _counting_numpy(numpy):
    def counted(self):
        array = numpy(self)
        _read[0] += array.nbytes
        return array
    return counted


def decode(engine, src: np.ndarray, beam: int, max_length: int, device: bool) -> tuple[list, float, int, int]:
    """One static batch; returns its token lists, seconds, steps (every output runs to its limit: the longest
    output's length) and bytes read."""
    from server.engine.decode import beam_search
    from server.engine.search import BeamSentence

    specs = [BeamSentence(int((row > 0).sum()), max_length=max_length, beam_size=beam) for row in src]
    start = time.perf_counter()
    _read[0] = 0
    results = beam_search(engine.model, engine.model.encode(src), specs, start_id=engine.start_id,
                          eos_id=engine.eos_id, plain_beam=device)
    seconds = time.perf_counter() - start
    tokens = [r.hypotheses[0].tokens for r in results]
    return tokens, seconds, max(map(len, tokens)), _read[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=sorted(SIZES), default="SMALL")
    parser.add_argument("--precision", choices=["fp32", "fp16"], default="fp32")
    parser.add_argument("--provider", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--beams", type=int, nargs="+", default=[4])
    parser.add_argument("--max-length", type=int, default=24)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--threads", type=int, default=2, help="ONNX Runtime intra-op threads")
    args = parser.parse_args()

    from server.engine.device_search import DeviceBeamRun
    from server.engine.engine import Engine

    OrtValue.numpy = _counting_numpy(OrtValue.numpy)
    DeviceBeamRun.step = _counting_steps(DeviceBeamRun.step)
    with tempfile.TemporaryDirectory() as tmp:
        version, _ = export_project(marian_model(args.size), Path(tmp), None, args.precision)
        engine = Engine.load(version, provider=args.provider, intra_op_threads=args.threads, device_state=True,
                             device_search=True)
        print(f"# {host()}; {args.size} {args.precision} on {engine.provider}, {args.max_length} tokens a sentence, "
              f"{args.repeats} calls a way, alternating")
        print("| batch | beam | host tok/s | device tok/s | device/host | host ms/step | device ms/step "
              "| bytes read/step, host | device | device, a quiet step |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        for beam in args.beams:
            for batch in args.batches:
                src = np.array(sources(batch, SIZES[args.size]["vocab"]), dtype=np.int64)
                runs: dict[bool, list[tuple[float, int, int]]] = {False: [], True: []}
                _quiet[:] = [0, 0]
                outputs = {}
                for i in range(args.repeats + 1):  # the first call of each way warms up
                    for device in (False, True) if i % 2 else (True, False):
                        tokens, seconds, steps, read = decode(engine, src, beam, args.max_length, device)
                        outputs[device] = tokens
                        if i:
                            runs[device].append((seconds, steps, read))
                if outputs[False] != outputs[True]:
                    raise SystemExit(f"batch {batch} beam {beam}: the two selections disagree")
                generated = sum(len(t) for t in outputs[True])
                cell = {}
                for device, rows in runs.items():
                    seconds = statistics.median(r[0] for r in rows)
                    cell[device] = (generated / seconds, 1000 * seconds / rows[0][1], rows[0][2] / rows[0][1])
                print(f"| {batch} | {beam} | {cell[False][0]:,.0f} | {cell[True][0]:,.0f} | "
                      f"{cell[True][0] / cell[False][0]:.2f}x | {cell[False][1]:.2f} | {cell[True][1]:.2f} | "
                      f"{cell[False][2]:,.0f} | {cell[True][2]:,.0f} | {_quiet[1] / max(_quiet[0], 1):,.0f} |",
                      flush=True)


if __name__ == "__main__":
    main()
