"""One runtime of the engine benchmark, alone in its own process (started by ``engine_throughput.py``).

    python benchmarks/runtime_worker.py RUNTIME MODEL JOB.json [--load-torch]

RUNTIME is ``project`` (this project's ONNX Runtime engine; MODEL is a model version directory),
``ctranslate2`` (MODEL is a converted CTranslate2 directory), ``pytorch`` (MODEL is a checkpoint; greedy only)
or ``generate`` (Hugging Face ``generate``; MODEL is the saved Marian directory). The job's ``provider`` (cpu
or cuda) places the project's engine, ``generate`` and CTranslate2. The worker imports only what its runtime
needs, so no other runtime's thread pool or OpenMP library shares the process. For each (batch, beam) cell of
the job it warms up, then decodes the same batch back to back for the job's fixed wall time and reports target
tokens/s. With the job's ``anatomy_tokens`` it also times each cell at that shorter output length and reports
the seconds per call at both lengths (the benchmark splits them into a fixed cost per call and a cost per
step); the project's worker then also reports the seconds per call spent inside its ONNX Runtime sessions (the
encoder's and the step decoders'), timed by wrappers around their ``run`` methods (~0.5 us a call).

It prints one JSON object on its last stdout line: tokens/s per cell, the greedy outputs of the
job's agreement batch, whether ``torch`` was loaded in the process, and a line describing the
runtime's backend. ``--load-torch`` imports torch and runs a few matrix products first (it reproduces
the same-process slowdown the old benchmark suffered; see benchmarks/README.md).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the source checkout's packages

Decode = Callable[..., list[list[int]]]  # (sources, beam, output length or None: the job's) -> output ids


class Runtime(NamedTuple):
    """A loaded runtime: its decode function, a line describing its backend, and (the project's, with
    ``anatomy_tokens``) the clock of its ONNX Runtime sessions."""

    decode: Decode
    backend: str
    clock: SessionClock | None = None


def project(model: str, job: dict) -> Runtime:
    """This project's engine: the model version, CPU, ``threads`` intra-op threads."""
    import onnxruntime as ort

    from server.config import ServerConfig
    from server.core.allocator import retain_freed_memory
    from server.engine.engine import Engine
    from server.types import DecodingOptions, SentenceRequest, TargetPrefix

    retain_mb = ServerConfig().malloc_retain_mb
    retained = retain_freed_memory(retain_mb << 20)  # as nmt serve sets malloc
    engine = Engine.load(model, provider=job.get("provider", "cpu"), intra_op_threads=job["threads"],
                         inter_op_threads=1, spinning=job.get("ort_spinning", True))
    clock = SessionClock(engine.model.sessions) if job.get("anatomy_tokens") else None

    languages = job.get("languages")  # a many-to-many model: its language tokens, the target's counted in lengths
    source_prefix = [languages["source"]] if languages else []
    target = TargetPrefix().led((languages["target"],) if languages else ())

    def decode(sources: list[list[int]], beam: int, length: int | None = None,
               attention: bool = False) -> list[list[int]]:
        options = DecodingOptions(beam_size=beam, max_length=(length or job["output_tokens"]) + len(target.ids),
                                  return_attention=attention)
        result = engine.translate_batch([SentenceRequest(source_prefix + ids, options, target_prefix=target)
                                         for ids in sources])
        return [t.hypotheses[0].token_ids for t in result.translations]

    spinning = "on" if job.get("ort_spinning", True) else "off"
    malloc = f"malloc keeps {retain_mb} MiB freed" if retained else "malloc as it is"
    kernels = "MLAS" if engine.device == "cpu" else engine.device
    return Runtime(decode, f"onnxruntime {ort.__version__}, {engine.provider}, {kernels}, spinning within a run "
                   f"{spinning}, {malloc}", clock)


def ctranslate2(model: str, job: dict) -> Runtime:
    """CTranslate2's Translator on the converted model; tokens are its ``t<id>`` pieces."""
    import ctranslate2 as ct2

    compute_type = {"fp32": "float32", "fp16": "float16", "int8": "int8"}[job["precision"]]
    translator = ct2.Translator(model, device=job.get("provider", "cpu"), compute_type=compute_type, inter_threads=1,
                                intra_threads=job["threads"])

    languages = job.get("languages")
    if languages:  # a converted many-to-many model: its own vocabulary, the language tokens as the tokenizer puts them
        vocabulary = json.loads((Path(model) / "shared_vocabulary.json").read_text())
        index = {piece: i for i, piece in enumerate(vocabulary)}

    def decode(sources: list[list[int]], beam: int, length: int | None = None) -> list[list[int]]:
        length = length or job["output_tokens"]
        if not languages:
            tokens = [[f"t{i}" for i in ids] + ["</s>"] for ids in sources]
            results = translator.translate_batch(tokens, beam_size=beam, max_decoding_length=length,
                                                 min_decoding_length=length, max_batch_size=0)
            return [[int(piece[1:]) for piece in r.hypotheses[0]] for r in results]
        tokens = [[languages["source_token"], *(vocabulary[i] for i in ids), "</s>"] for ids in sources]
        results = translator.translate_batch(tokens, target_prefix=[[languages["target_token"]]] * len(tokens),
                                             beam_size=beam, max_decoding_length=length + 1,
                                             min_decoding_length=length + 1, max_batch_size=0)
        return [[index[piece] for piece in r.hypotheses[0][1:]] for r in results]

    return Runtime(decode, f"ctranslate2 {ct2.__version__}, compute type {compute_type}")


def pytorch(model: str, job: dict) -> Runtime:
    """This project's PyTorch Transformer with its batched greedy decoder (KV cache)."""
    import torch

    from training.models.checkpoint import load_checkpoint
    from training.search import greedy_batch

    torch.set_num_threads(job["threads"])
    net, _ = load_checkpoint(model)

    def decode(sources: list[list[int]], beam: int, length: int | None = None) -> list[list[int]]:
        if beam != 1:
            raise ValueError("the PyTorch runtime decodes greedily only")
        src = torch.tensor([ids + [net.config.eos_id] for ids in sources])
        return greedy_batch(net, src, length or job["output_tokens"])

    return Runtime(decode, f"torch {torch.__version__}, CPU capability {torch.backends.cpu.get_cpu_capability()}")


def generate(model: str, job: dict) -> Runtime:
    """Hugging Face ``MarianMTModel.generate`` on the same weights (MODEL is the saved Marian directory), on
    the job's device (``cuda`` for the CUDA provider) in the job's precision (fp32 or fp16), greedy or beam."""
    import torch
    import transformers
    from transformers import MarianMTModel

    device = "cuda" if job.get("provider") == "cuda" else "cpu"
    dtype = torch.float16 if job["precision"] == "fp16" else torch.float32
    torch.set_num_threads(job["threads"])
    net = MarianMTModel.from_pretrained(model, torch_dtype=dtype).to(device).eval()
    eos = net.config.eos_token_id

    def decode(sources: list[list[int]], beam: int, length: int | None = None) -> list[list[int]]:
        length = length or job["output_tokens"]
        src = torch.tensor([ids + [eos] for ids in sources], device=device)
        with torch.inference_mode():
            out = net.generate(src, attention_mask=torch.ones_like(src), num_beams=beam, do_sample=False,
                               max_new_tokens=length, min_new_tokens=length, forced_eos_token_id=None)
        return [row[1:].tolist() for row in out]  # without the decoder start

    name = torch.cuda.get_device_name() if device == "cuda" else f"CPU {torch.backends.cpu.get_cpu_capability()}"
    return Runtime(decode, f"transformers {transformers.__version__} generate, torch {torch.__version__}, {name}, "
                   f"{str(dtype).removeprefix('torch.')}")


RUNTIMES = {"project": project, "ctranslate2": ctranslate2, "pytorch": pytorch, "generate": generate}


class SessionClock:
    """Seconds spent inside ONNX Runtime sessions ("encoder", and "decoder" for the step graphs), timed by
    wrappers installed on the sessions' ``run`` and ``run_with_iobinding``, and the host's time between two
    step-graph runs of one call (``gaps``: the search's work per step; an encoder run starts a call)."""

    def __init__(self, sessions: dict) -> None:
        self.seconds = {"encoder": 0.0, "decoder": 0.0}
        self.gaps: list[float] = []
        self._last_step: float | None = None  # when the last step-graph run of this call ended
        for role, session in sessions.items():
            for method in ("run", "run_with_iobinding"):
                setattr(session, method, self._timed(getattr(session, method), "encoder" if role == "encoder"
                                                     else "decoder"))

    def _timed(self, call: Callable, graph: str) -> Callable:
        def timed(*args, **kwargs):
            start = time.perf_counter()
            if graph == "decoder" and self._last_step is not None:
                self.gaps.append(start - self._last_step)
            try:
                return call(*args, **kwargs)
            finally:
                end = time.perf_counter()
                self.seconds[graph] += end - start
                self._last_step = end if graph == "decoder" else None
        return timed

    def reset(self) -> None:
        self.seconds = dict.fromkeys(self.seconds, 0.0)
        self.gaps, self._last_step = [], None


def load_torch() -> None:
    """Import torch and run a few matrix products, as the old single-process benchmark did."""
    import torch

    a = torch.rand(256, 256)
    for _ in range(10):
        a = (a @ a).clamp(-1, 1)


def sustained(decode: Callable[[], object], seconds: float) -> tuple[int, float]:
    """Calls of ``decode`` back to back for at least ``seconds`` (after one warm-up call): (calls, elapsed)."""
    decode()
    calls, start = 0, time.perf_counter()
    while True:
        decode()
        calls += 1
        elapsed = time.perf_counter() - start
        if elapsed >= seconds:
            return calls, elapsed


def gemm_gflops(threads: int, n: int = 1024, repeats: int = 10) -> float:
    """fp32 GEMM rate of this machine through ONNX Runtime's MatMul (MLAS), ``threads`` threads."""
    import numpy as np
    import onnxruntime as ort
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [helper.make_node("MatMul", ["a", "b"], ["c"])], "gemm",
        [helper.make_tensor_value_info("a", TensorProto.FLOAT, [n, n]),
         helper.make_tensor_value_info("b", TensorProto.FLOAT, [n, n])],
        [helper.make_tensor_value_info("c", TensorProto.FLOAT, [n, n])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    a = np.random.rand(n, n).astype(np.float32)
    session.run(None, {"a": a, "b": a})
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        session.run(None, {"a": a, "b": a})
        best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runtime", choices=sorted(RUNTIMES))
    parser.add_argument("model", help="model version directory, CTranslate2 directory or checkpoint")
    parser.add_argument("job", type=Path, help="the job JSON written by engine_throughput.py")
    parser.add_argument("--load-torch", action="store_true", help="import torch and use it before measuring")
    args = parser.parse_args()
    job = json.loads(args.job.read_text())
    if args.load_torch:
        load_torch()
    decode, backend, clock = RUNTIMES[args.runtime](args.model, job)
    report: dict = {"runtime": args.runtime, "backend": backend, "tok_s": {}, "call_s": {}, "ort_s": {},
                    "step_gap_s": {}}
    report["check"] = decode(job["check"], 1)
    for batch, beam in job["cells"]:
        sources = job["sources"][str(batch)]
        if clock:
            clock.reset()
        calls, elapsed = sustained(lambda sources=sources, beam=beam: decode(sources, beam), job["seconds"])
        report["tok_s"][f"{batch}x{beam}"] = calls * batch * job["output_tokens"] / elapsed
        if clock:  # per call, over the warm-up call too
            report["ort_s"][f"{batch}x{beam}"] = [clock.seconds["encoder"] / (calls + 1),
                                                  clock.seconds["decoder"] / (calls + 1)]
            report["step_gap_s"][f"{batch}x{beam}"] = statistics.median(clock.gaps)
        if job.get("anatomy_tokens"):
            short = job["anatomy_tokens"]
            short_calls, short_elapsed = sustained(
                lambda sources=sources, beam=beam, short=short: decode(sources, beam, short), job["seconds"])
            report["call_s"][f"{batch}x{beam}"] = [short_elapsed / short_calls, elapsed / calls]
    if args.runtime == "project" and job.get("attention_cell"):
        batch = job["attention_cell"]
        sources = job["sources"][str(batch)]
        calls, elapsed = sustained(lambda: decode(sources, 1, attention=True), job["seconds"])
        report["tok_s"][f"{batch}x1+attention"] = calls * batch * job["output_tokens"] / elapsed
        report["gemm_gflops"] = gemm_gflops(job["threads"])
    report["torch_loaded"] = "torch" in sys.modules
    print(json.dumps(report))


if __name__ == "__main__":
    main()
