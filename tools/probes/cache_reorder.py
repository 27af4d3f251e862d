"""Reordering a beam's KV cache: copying the rows that moved against cache indirection, one decoder layer.

    python benchmarks/cache_reorder.py                                   # SMALL's and BASE's layer shapes, CPU
    python benchmarks/cache_reorder.py --provider cuda --precision fp16  # on a GPU

After each beam step a hypothesis may continue another row's hypothesis, so its self-attention cache must read
that row's past keys and values. The engine's plain beam steps (``server/engine/host_runs.py``) copy the rows of
second continuations (all layers in one NumPy call) and run ``com.microsoft.GroupQueryAttention`` over the cache
in place. ONNX Runtime's ``com.microsoft.DecoderMaskedMultiHeadAttention`` could instead read each position
through a ``cache_indirection`` table (``[batch, beam, capacity]``: which beam of the sentence holds that
position), so that a reorder is an update of that small table and no cache row moves.

Each cell times, on one decoder layer's shapes (``--heads`` x ``--head-dim``, a cache of ``--capacity``
positions, ``--position`` of them filled, batch x beam rows), the median of ``--runs`` runs after a warm-up:

* ``GQA``: the export's in-place attention node alone (I/O bound to ``OrtValue`` s, the cache bound as past and
  present);
* ``copy``: the plain beam steps' copy of ``--moved`` of the rows (keys and values, fancy indexing), which a
  step pays on top of ``GQA`` (on the CPU only: on a GPU the rows move by ``Gather`` sessions);
* ``DMMHA``: the indirection node alone, past and present one buffer, with a random indirection table.

Before timing, every cell checks that the two nodes agree: ``DMMHA`` over the cache and a random table against
``GQA`` over a cache whose rows were gathered by that table (within 1e-4 in fp32, 1e-2 in fp16).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a script: this checkout's packages
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))  # the benchmarks' shared modules

from bench_common import host  # noqa: E402

SHAPES = {"SMALL": (4, 64), "BASE": (8, 64)}  # heads, head dim of engine_throughput.py's sizes
ELEMENT = {"fp32": (TensorProto.FLOAT, np.float32), "fp16": (TensorProto.FLOAT16, np.float16)}
HOST_INPUTS = ("total_length", "past_length", "beam_width")


def attention_graph(kind: str, rows: int, beam: int, heads: int, head_dim: int, capacity: int,
                    element: int) -> onnx.ModelProto:
    """One self-attention node over an in-place cache: ``GQA`` (per-row positions) or ``DMMHA`` (indirection)."""
    hidden = heads * head_dim
    vi = helper.make_tensor_value_info
    cache = [rows, heads, capacity, head_dim]
    inputs = [vi(name, element, [rows, 1, hidden]) for name in ("q", "k", "v")]
    inputs += [vi("past_key", element, cache), vi("past_value", element, cache)]
    outputs = ["out", "present_key", "present_value"]
    if kind == "GQA":
        inputs += [vi("seqlens_k", TensorProto.INT32, [rows]), vi("total_length", TensorProto.INT32, [])]
        node = helper.make_node("GroupQueryAttention", ["q", "k", "v", "past_key", "past_value", "seqlens_k",
                                                        "total_length"], outputs, domain="com.microsoft",
                                num_heads=heads, kv_num_heads=heads)
    else:
        inputs += [vi("past_length", TensorProto.INT32, [1]), vi("beam_width", TensorProto.INT32, [1]),
                   vi("cache_indirection", TensorProto.INT32, [rows // beam, beam, capacity])]
        node = helper.make_node("DecoderMaskedMultiHeadAttention",
                                ["q", "k", "v", "", "", "past_key", "past_value", "past_length", "beam_width",
                                 "cache_indirection"], outputs, domain="com.microsoft",
                                num_heads=heads, past_present_share_buffer=1)
    graph = helper.make_graph([node], kind, inputs,
                              [vi("out", element, None), vi("present_key", element, cache),
                               vi("present_value", element, cache)])
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    return helper.make_model(graph, opset_imports=opsets)


class Node:
    """A session of one attention graph with its inputs and outputs bound to ``OrtValue`` s on the device."""

    def __init__(self, model: onnx.ModelProto, feeds: dict[str, np.ndarray], provider: str, threads: int) -> None:
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        providers = ["CUDAExecutionProvider"] if provider == "cuda" else ["CPUExecutionProvider"]
        self.session = ort.InferenceSession(model.SerializeToString(), options, providers=providers)
        self.binding = self.session.io_binding()
        # lengths and the beam width are read on the host by the CUDA kernels (CPU inputs): they stay there
        self.values = {name: ort.OrtValue.ortvalue_from_numpy(array, "cpu" if name in HOST_INPUTS else provider, 0)
                       for name, array in feeds.items()}
        for name, value in self.values.items():
            self.binding.bind_ortvalue_input(name, value)
        self.binding.bind_output("out", provider)  # the first output bound: get_outputs()[0]
        self.binding.bind_ortvalue_output("present_key", self.values["past_key"])  # in place, as the engine
        self.binding.bind_ortvalue_output("present_value", self.values["past_value"])

    def run(self) -> np.ndarray:
        self.session.run_with_iobinding(self.binding)
        self.binding.synchronize_outputs()
        return self.binding.get_outputs()[0].numpy()

    def seconds(self, runs: int) -> float:
        times = []
        for _ in range(runs):
            start = time.perf_counter()
            self.session.run_with_iobinding(self.binding)
            self.binding.synchronize_outputs()
            times.append(time.perf_counter() - start)
        return statistics.median(times)


def cell(size: str, batch: int, beam: int, args: argparse.Namespace) -> dict[str, float]:
    """Microseconds per run of each way (module docstring), after checking that the two nodes agree."""
    heads, head_dim = SHAPES[size]
    element, dtype = ELEMENT[args.precision]
    rows, capacity, position = batch * beam, args.capacity, args.position
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((rows, 1, heads * head_dim)).astype(dtype) for _ in range(3))
    past_key = rng.standard_normal((rows, heads, capacity, head_dim)).astype(dtype)
    past_value = rng.standard_normal((rows, heads, capacity, head_dim)).astype(dtype)
    table = rng.integers(0, beam, (batch, beam, capacity), dtype=np.int32)  # which beam holds each position
    table[:, :, position] = np.arange(beam, dtype=np.int32)  # the new entry is each row's own
    source = (np.arange(batch)[:, None, None] * beam + table).reshape(rows, capacity)
    gathered = [cache[source, :, np.arange(capacity)].transpose(0, 2, 1, 3).copy() for cache in (past_key, past_value)]
    gqa_feeds = {"q": q, "k": k, "v": v, "seqlens_k": np.full(rows, position, np.int32),
                 "total_length": np.array(capacity, np.int32)}
    gqa = Node(attention_graph("GQA", rows, beam, heads, head_dim, capacity, element),
               {**gqa_feeds, "past_key": gathered[0], "past_value": gathered[1]}, args.provider, args.threads)
    dmmha = Node(attention_graph("DMMHA", rows, beam, heads, head_dim, capacity, element),
                 {"q": q, "k": k, "v": v, "past_key": past_key, "past_value": past_value,
                  "past_length": np.array([position], np.int32), "beam_width": np.array([beam], np.int32),
                  "cache_indirection": table}, args.provider, args.threads)
    difference = float(np.abs(gqa.run().astype(np.float32) - dmmha.run().astype(np.float32)).max())
    if difference > (1e-4 if args.precision == "fp32" else 1e-2):
        raise SystemExit(f"{size} batch {batch} beam {beam}: the two nodes differ by {difference:.2e}")
    result = {"GQA": gqa.seconds(args.runs) * 1e6, "DMMHA": dmmha.seconds(args.runs) * 1e6, "difference": difference}
    if args.provider == "cpu":
        moved = max(1, round(args.moved * rows))
        src, dst = rng.choice(rows, moved, replace=False), rng.choice(rows, moved, replace=False)
        times = []
        for _ in range(args.runs):
            start = time.perf_counter()
            for cache in (past_key, past_value):
                cache[dst, :, :position] = cache[src, :, :position]
            times.append(time.perf_counter() - start)
        result["copy"] = statistics.median(times) * 1e6
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--sizes", nargs="+", choices=sorted(SHAPES), default=["SMALL", "BASE"])
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 8, 32])
    parser.add_argument("--beam", type=int, default=4)
    parser.add_argument("--capacity", type=int, default=64, help="cache positions (the engine's: a power of two)")
    parser.add_argument("--position", type=int, default=20, help="positions filled before this step")
    parser.add_argument("--moved", type=float, default=0.3,
                        help="share of the rows the copy moves (measured on the plain beam steps: 0.23-1.2 a "
                             "step at batch 1, ~0.3 of the rows at batch 8)")
    parser.add_argument("--provider", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--precision", choices=sorted(ELEMENT), default="fp32")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--runs", type=int, default=400)
    args = parser.parse_args()
    if not 0 <= args.position < args.capacity:
        parser.error("--position must be below --capacity")
    print(f"{host()}; ONNX Runtime {ort.__version__} ({args.provider}, {args.precision}, {args.threads} threads)")
    print(f"one decoder layer, beam {args.beam}, cache {args.capacity} positions with {args.position} filled, "
          f"medians of {args.runs} runs, microseconds")
    copy = args.provider == "cpu"
    print("| size | batch | rows | GQA |" + (" copy of moved rows | GQA + copy |" if copy else "")
          + " DMMHA (indirection) | DMMHA / (GQA + copy) | max difference |")
    print("|---|---|---|---|" + ("---|---|" if copy else "") + "---|---|---|")
    for size in args.sizes:
        for batch in args.batches:
            r = cell(size, batch, args.beam, args)
            paid = r["GQA"] + r.get("copy", 0.0)
            print(f"| {size} | {batch} | {batch * args.beam} | {r['GQA']:.1f} |"
                  + (f" {r['copy']:.1f} | {paid:.1f} |" if copy else "")
                  + f" {r['DMMHA']:.1f} | {r['DMMHA'] / paid:.2f}x | {r['difference']:.1e} |", flush=True)


if __name__ == "__main__":
    main()
