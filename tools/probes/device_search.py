"""Beam search's selection on the device against the host's, on the engine that keeps its state on the device.

    python benchmarks/device_search.py --size SMALL --batches 1 8 32 --beams 4
    python benchmarks/device_search.py --size SMALL --precision fp16 --provider cuda --cuda-graphs   # on a GPU

One random-weight Marian model of ``--size`` (``engine_throughput.py``'s; EOS suppressed, so every output has
``--max-length`` tokens) exported in ``--precision`` and loaded as CUDA versions load
(:class:`server.engine.device_step_model.DeviceStepModel`: encoder outputs and KV cache as ``OrtValue`` s, rows
moved by ``Gather`` sessions; on the CPU forced with ``device_state=True``). Each cell decodes one static batch
two ways, alternating call by call in this process (``--repeats`` calls each, medians):

* ``host``: each step's best tokens come to the host, which selects the hypotheses
  (:func:`server.engine.beam_select.select_beam`) and sends the rows back for the cache's ``Gather``;
* ``device``: the selection graph (:mod:`server.engine.device_runs`) chooses on the device; the host reads one
  byte a sentence per step;
* ``graphs`` (with ``--cuda-graphs``): as ``device``, on an engine loaded with ``cuda_graphs``
  (:mod:`server.engine.cuda_graphs`: runs padded to their shape bucket and kept; on CUDA each step's three
  session runs captured once and replayed; at beam 1 the arg-max steps, in blocks launched back to back,
  :mod:`server.engine.device_runs`; on the CPU nothing captures, so the column shows what the padding and the
  copies in and out cost).

Per cell: tokens/s, milliseconds a step, the host's bytes read from the device per step (every
``OrtValue.numpy()`` of the decode, counted, over the whole call) and, for the device's selection, per quiet step
(one byte a sentence), and the ratio device/host; outputs must agree (a cell where they do not is reported, and
the run fails at its end).
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

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a script: this checkout's packages
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))  # the benchmarks' shared modules

from bench_common import host  # noqa: E402
from engine_throughput import SIZES, export_project, marian_model, sources  # noqa: E402

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
    from server.engine.step_model import BeamSentence

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
    parser.add_argument("--cuda-graphs", action="store_true",
                        help="a third way: the device's selection with CUDA graphs (cuda_graphs=True)")
    args = parser.parse_args()

    from server.engine.device_runs import DeviceBeamRun
    from server.engine.engine import Engine

    OrtValue.numpy = _counting_numpy(OrtValue.numpy)
    DeviceBeamRun.step = _counting_steps(DeviceBeamRun.step)
    with tempfile.TemporaryDirectory() as tmp:
        version, _ = export_project(marian_model(args.size), Path(tmp), None, args.precision)
        load = {"provider": args.provider, "intra_op_threads": args.threads, "device_state": True,
                "device_search": True}
        engine = Engine.load(version, **load)
        # way -> (engine, the device's selection)
        ways = {"host": (engine, False), "device": (engine, True)}
        if args.cuda_graphs:
            ways["graphs"] = (Engine.load(version, **load, cuda_graphs=True), True)
        print(f"# {host()}; {args.size} {args.precision} on {engine.provider}, {args.max_length} tokens a sentence, "
              f"{args.repeats} calls a way, alternating")
        graph_columns = " | graphs tok/s | graphs/device | graphs ms/step" if args.cuda_graphs else ""
        print("| batch | beam | host tok/s | device tok/s | device/host | host ms/step | device ms/step "
              f"| bytes read/step, host | device | device, a quiet step{graph_columns} |")
        print("|---" * (10 + 3 * args.cuda_graphs) + "|")
        disagreements: list[str] = []
        for beam in args.beams:
            for batch in args.batches:
                src = np.array(sources(batch, SIZES[args.size]["vocab"]), dtype=np.int64)
                runs: dict[str, list[tuple[float, int, int]]] = {way: [] for way in ways}
                _quiet[:] = [0, 0]
                outputs = {}
                for i in range(args.repeats + 1):  # the first call of each way warms up
                    order = list(ways) if i % 2 else list(ways)[::-1]
                    for way in order:
                        way_engine, on_device = ways[way]
                        tokens, seconds, steps, read = decode(way_engine, src, beam, args.max_length, on_device)
                        outputs[way] = tokens
                        if i:
                            runs[way].append((seconds, steps, read))
                for way, tokens in outputs.items():  # reported, and the run fails at its end
                    if differ := sum(a != b for a, b in zip(tokens, outputs["host"], strict=True)):
                        disagreements.append(f"batch {batch} beam {beam}: {way} differs from host in {differ} "
                                             f"of {batch} sentences")
                        print(f"# {disagreements[-1]}", flush=True)
                generated = sum(len(t) for t in outputs["host"])
                cell = {}
                for way, rows in runs.items():
                    seconds = statistics.median(r[0] for r in rows)
                    cell[way] = (generated / seconds, 1000 * seconds / rows[0][1], rows[0][2] / rows[0][1])
                graphs = (f" {cell['graphs'][0]:,.0f} | {cell['graphs'][0] / cell['device'][0]:.2f}x | "
                          f"{cell['graphs'][1]:.2f} |" if args.cuda_graphs else "")
                print(f"| {batch} | {beam} | {cell['host'][0]:,.0f} | {cell['device'][0]:,.0f} | "
                      f"{cell['device'][0] / cell['host'][0]:.2f}x | {cell['host'][1]:.2f} | {cell['device'][1]:.2f} | "
                      f"{cell['host'][2]:,.0f} | {cell['device'][2]:,.0f} | {_quiet[1] / max(_quiet[0], 1):,.0f} |"
                      f"{graphs}", flush=True)
        if disagreements:
            raise SystemExit("the selections disagree: " + "; ".join(disagreements))


if __name__ == "__main__":
    main()
