"""The CUDA path, run where a CUDA session really runs (skipped elsewhere, with the reason).

The skip does not trust ``get_available_providers()`` (onnxruntime-gpu lists CUDA even without its
libraries): it opens a one-node CUDA session, checks ``get_providers()[0]`` and runs it on a device buffer.

Tolerances: CUDA and the CPU sum in different orders and CUDA's MatMul may use TF32 (``--cuda-tf32``, off
by default and in these tests), so scores and attention are compared within 1e-3, tokens exactly.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import subprocess
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from server.core.scheduler import ModelScheduler
from server.engine.decode import RunningDecode
from server.engine.device import (
    CUDA,
    DeviceSettings,
    cuda_unavailable_reason,
    nodes_without_cuda_kernel,
    probe_provider,
    provider_list,
    shape_arithmetic,
    with_node_names,
)
from server.engine.device_runs import DeviceBeamRun
from server.engine.engine import DeviceStepModel, Engine, OnnxStepModel, session_options
from server.engine.host_runs import GreedySteps
from server.engine.session_graphs import inline_self_attention, needs_portable_attention
from server.frontend.translate import translate_texts
from server.policy import BatchPolicy
from server.types import DecodingOptions, SentenceRequest
from tests.test_engine import TEXTS

KERNEL_TIME = "_kernel_time"  # the suffix of a node's name in a profile's kernel events
TOLERANCE = 1e-3  # CUDA vs CPU (fp32, TF32 off)


def cuda_skip_reason() -> str | None:
    """None when a CUDA session really runs here, else why not."""
    if CUDA not in ort.get_available_providers():
        return f"no CUDA in this onnxruntime build ({ort.get_device()})"
    try:
        if probe_provider(DeviceSettings("auto")) != CUDA:
            return f"CUDA listed but a session does not get it: {cuda_unavailable_reason()}"
        ort.OrtValue.ortvalue_from_numpy(np.zeros(1, np.float32), "cuda", 0)
    except Exception as error:  # noqa: BLE001 - any failure means no usable GPU
        return f"CUDA session does not run: {error}"
    return None


REASON = cuda_skip_reason()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"needs a GPU where a CUDA session runs: {REASON}")


@pytest.fixture(scope="module")
def cpu(tiny_models) -> dict[str, Engine]:
    return {arch: Engine.load(path, provider="cpu", intra_op_threads=1) for arch, path in tiny_models.items()}


@pytest.fixture(scope="module")
def gpu(tiny_models) -> dict[str, Engine]:
    return {arch: Engine.load(path, provider="cuda") for arch, path in tiny_models.items()}


@pytest.mark.parametrize("arch", ["transformer", "bahdanau"])
def test_every_session_runs_on_cuda(arch, gpu):
    engine = gpu[arch]
    assert engine.provider == CUDA and engine.device == "cuda:0"
    assert isinstance(engine.model, DeviceStepModel) and engine.model.device == "cuda"
    sessions = {**engine.model.sessions, **{f"gather {t}": s for t, s in engine.model.gather_sessions.items()}}
    assert {role: s.get_providers()[0] for role, s in sessions.items()} == dict.fromkeys(sessions, CUDA)


@pytest.mark.parametrize("arch", ["transformer", "bahdanau"])
def test_weights_are_held_once_in_device_memory(arch, gpu):
    """Every session of the version reads the same device buffers (``SessionOptions.add_initializer`` with
    CUDA ``OrtValue``s), not a copy of its own made from host buffers."""
    weights = gpu[arch].model.weights
    assert weights is not None and weights.device == "cuda"
    assert weights.values and {value.device_name() for value in weights.values.values()} == {"cuda"}


def _off_cuda(version_dir: Path, tmp_path: Path) -> tuple[set[tuple[str, str]], set[tuple[str, str]]]:
    """(node, op) of the nodes ONNX Runtime's profile saw run off CUDA, shape arithmetic left out, and of the
    nodes :func:`server.engine.device.nodes_without_cuda_kernel` predicts from the kernel table, over every graph
    of the version after a beam-4 translation. The rule of what shape arithmetic is applies to the graph the
    session ran (ONNX Runtime's optimized graph, saved beside the profile)."""
    engine = Engine.load(version_dir, provider="cuda")  # manifest and tokenizer
    providers = provider_list(DeviceSettings("cuda"))
    sessions = {}
    for role, filename in engine.manifest.graphs.items():
        options = session_options(0, 1, spinning=False)
        options.enable_profiling = True
        options.profile_file_prefix = str(tmp_path / role)
        options.optimized_model_filepath = str(tmp_path / f"{role}.optimized.onnx")
        model = onnx.load(version_dir / filename)
        if needs_portable_attention(model):  # as Engine.load opens an fp32 version's step graphs on CUDA
            inline_self_attention(model)
        onnx.save(with_node_names(model), tmp_path / filename)  # names in the profile
        sessions[role] = ort.InferenceSession(str(tmp_path / filename), options, providers=providers)
    profiled = Engine(engine.manifest, engine.tokenizer, OnnxStepModel(engine.manifest, sessions), CUDA)
    profiled.translate(TEXTS, DecodingOptions(beam_size=4, num_hypotheses=1, return_attention=True))
    off_cuda, predicted = set(), set()
    for role, session in sessions.items():
        ran = onnx.load(tmp_path / f"{role}.optimized.onnx")
        shape_only = shape_arithmetic(ran)
        for event in json.loads(Path(session.end_profiling()).read_text()):
            args, name = event.get("args", {}), event.get("name", "")
            if event.get("cat") == "Node" and name.endswith(KERNEL_TIME) and args.get("provider") != CUDA:
                node = name.removesuffix(KERNEL_TIME)
                if node not in shape_only:
                    off_cuda.add((node, args.get("op_name")))
        opened = onnx.load(tmp_path / engine.manifest.graphs[role])
        predicted.update((u.node, u.op.rpartition(".")[2]) for u in nodes_without_cuda_kernel(opened))
    return off_cuda, predicted


@pytest.mark.parametrize("arch", ["transformer", "bahdanau"])
def test_fp32_nodes_run_off_cuda_exactly_where_the_kernel_table_says(arch, tiny_models, tmp_path):
    """ONNX Runtime's profile names the provider of every node it ran; the nodes off CUDA (shape arithmetic
    aside) are the ones tests/test_placement.py finds without a CUDA kernel in the graphs the sessions open:
    none, now that an fp32 Transformer's self-attention is opened in its portable form on CUDA (before,
    its GroupQueryAttention nodes ran on the CPU provider)."""
    off_cuda, predicted = _off_cuda(tiny_models[arch], tmp_path)
    assert off_cuda == predicted == set()


@pytest.mark.parametrize("arch", ["transformer", "bahdanau"])
@pytest.mark.parametrize("beam", [1, 4])
def test_cuda_decodes_like_the_cpu_with_finite_attention(arch, beam, cpu, gpu):
    options = DecodingOptions(beam_size=beam, num_hypotheses=beam, return_attention=True)
    for on_cpu, on_gpu in zip(cpu[arch].translate(TEXTS, options), gpu[arch].translate(TEXTS, options), strict=True):
        assert [h.token_ids for h in on_gpu.hypotheses] == [h.token_ids for h in on_cpu.hypotheses]
        for a, b in zip(on_gpu.hypotheses, on_cpu.hypotheses, strict=True):
            assert a.score == pytest.approx(b.score, abs=TOLERANCE)
            assert np.isfinite(a.attention.weights).all()
            np.testing.assert_allclose(a.attention.weights, b.attention.weights, atol=TOLERANCE)


def test_plain_greedy_steps_on_cuda_decode_like_the_cpu(cpu, gpu, monkeypatch):
    """Plain arg-max steps on CUDA (:class:`GreedySteps`: the cache on the device, the ids and positions bound
    on the host, the top-1 output written into the next step's input) give the CPU's tokens and scores."""
    models = []
    step = GreedySteps.run

    def counted(self: GreedySteps) -> None:
        models.append(type(self.model))
        step(self)

    monkeypatch.setattr(GreedySteps, "run", counted)
    options = DecodingOptions(beam_size=1, num_hypotheses=1)
    engine = gpu["transformer"]
    for on_cpu, on_gpu in zip(cpu["transformer"].translate(TEXTS, options), engine.translate(TEXTS, options),
                              strict=True):
        assert [h.token_ids for h in on_gpu.hypotheses] == [h.token_ids for h in on_cpu.hypotheses]
        assert on_gpu.hypotheses[0].score == pytest.approx(on_cpu.hypotheses[0].score, abs=TOLERANCE)
    assert type(engine.model) in models, "the CUDA decode took the plain steps"


def test_held_rows_on_cuda_decode_like_the_cpu(cpu, gpu):
    """A static batch on CUDA, whose ended rows run on unread until the run of plain steps ends
    (``RunningDecode.hold_ended``, the default on a device), gives the CPU's tokens and scores."""
    engine, requests = gpu["transformer"], [SentenceRequest(cpu["transformer"].tokenize(t), DecodingOptions())
                                            for t in TEXTS]
    encoded, sentences, _ = engine.encode(requests)
    decode = RunningDecode(engine.model, start_id=engine.start_id, eos_id=engine.eos_id, hold_ended=True)
    decode.admit(encoded, sentences, range(len(requests)))
    results = {}
    while decode.rows:
        results.update(decode.step(until_leave=True))
    for i, expected in enumerate(cpu["transformer"].search(requests)):
        [ours], [theirs] = results[i].hypotheses, expected.hypotheses
        assert ours.tokens == theirs.tokens
        assert ours.score == pytest.approx(theirs.score, abs=TOLERANCE)


@pytest.mark.parametrize("arch", ["transformer", "bahdanau"])
def test_the_selection_on_cuda_decodes_like_the_cpu(arch, tiny_models, cpu, monkeypatch):
    """Beam search's selection on the device (``device_search``): the CPU's hypotheses and scores, the quiet steps
    run on CUDA (the selection and the state's ``Gather`` sessions there too), each reading one byte a sentence."""
    reads = []
    step = DeviceBeamRun.step

    def counted(self: DeviceBeamRun) -> bool:
        before = self.bytes_read
        done = step(self)
        reads.append((len(self.done), self.bytes_read - before))
        return done

    monkeypatch.setattr(DeviceBeamRun, "step", counted)
    engine = Engine.load(tiny_models[arch], provider="cuda", device_search=True)
    options = DecodingOptions(beam_size=4, num_hypotheses=2, length_penalty=0.6)
    for on_cpu, on_gpu in zip(cpu[arch].translate(TEXTS, options), engine.translate(TEXTS, options), strict=True):
        assert [h.token_ids for h in on_gpu.hypotheses] == [h.token_ids for h in on_cpu.hypotheses]
        for a, b in zip(on_gpu.hypotheses, on_cpu.hypotheses, strict=True):
            assert a.score == pytest.approx(b.score, abs=TOLERANCE)
    assert reads and all(read == sentences for sentences, read in reads)
    sessions = [engine.model.selection_session(4, engine.eos_id, engine.start_id, 8),
                *engine.model.gather_sessions.values()]
    assert sessions and {s.get_providers()[0] for s in sessions} == {CUDA}


@pytest.mark.parametrize("arch", ["transformer", "bahdanau"])
@pytest.mark.parametrize("beam", [1, 4])
def test_captured_runs_decode_like_the_cpu(arch, beam, tiny_models, cpu, caplog):
    """``cuda_graphs``: the device's beam runs and arg-max runs captured as CUDA graphs on their buckets' first runs
    and replayed after (the same texts four times: the kept runs start again), the CPU's hypotheses and scores,
    no capture failed, nothing said about falling back."""
    engine = Engine.load(tiny_models[arch], provider="cuda", device_search=True, cuda_graphs=True)
    model = engine.model
    assert model.capture.enabled, model.capture.reason
    options = DecodingOptions(beam_size=beam, num_hypotheses=min(beam, 2), length_penalty=0.6)
    expected = cpu[arch].translate(TEXTS, options)
    with caplog.at_level(logging.WARNING, logger="nmt.server"):
        for _ in range(4):
            for on_cpu, on_gpu in zip(expected, engine.translate(TEXTS, options), strict=True):
                assert [h.token_ids for h in on_gpu.hypotheses] == [h.token_ids for h in on_cpu.hypotheses]
                for a, b in zip(on_gpu.hypotheses, on_cpu.hypotheses, strict=True):
                    assert a.score == pytest.approx(b.score, abs=TOLERANCE)
    if beam == 1 and not model.capabilities.greedy_steps:
        return  # its arg-max steps are the general step's, which runs no graph
    assert model.capture.failures == 0 and model.capture.captured_runs > 0 and model.pool.reused > 0
    assert not [r for r in caplog.records if r.getMessage().startswith("CUDA graphs")]


def _device_memory_mib() -> int:
    """Device memory this process holds (nvidia-smi), in MiB."""
    out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, check=True).stdout
    return sum(int(used) for pid, used in (line.split(", ") for line in out.splitlines()) if int(pid) == os.getpid())


@pytest.mark.skipif(shutil.which("nvidia-smi") is None, reason="needs nvidia-smi to read device memory")
def test_device_memory_levels_off(gpu):
    engine = gpu["transformer"]
    longest = " ".join(["seven eight nine"] * 20)
    options = DecodingOptions(beam_size=4, num_hypotheses=1, max_length=engine.max_positions, return_attention=True)
    levels = []
    for _ in range(50):
        engine.translate([longest] * 32, options)
        levels.append(_device_memory_mib())
    assert max(levels[2:]) <= levels[1], f"device memory still grows after the second batch: {levels}"


@pytest.mark.parametrize(("beam", "hold"), [(2, "on"), (1, "on"), (1, "off")], ids=["beam-2", "greedy", "greedy-cut"])
def test_continuous_batching_on_cuda_encodes_beside_the_decode_like_the_cpu(beam, hold, cpu, gpu):
    """The default on CUDA: continuous batching with the joining sentences encoded on a thread of their own
    (a device rule), the encoder's session running beside the decoder's, and ended rows running on unread
    (a device rule), greedy also without; every sentence decodes as on the CPU alone."""
    decode_beside_encoder_calls(gpu["transformer"], cpu["transformer"], beam, hold)


@pytest.mark.parametrize("beam", [1, 2], ids=["greedy", "beam-2"])
def test_cuda_graph_captures_take_turns_with_the_encoder_beside_the_decode(beam, cpu, tiny_models):
    """``--cuda-graphs`` with the encoder beside the decode: the worker's runs that may capture and the encoder's
    calls take turns (``cuda_graphs.CAPTURE_GATE``), so no capture fails and every sentence decodes as on the CPU."""
    engine = Engine.load(tiny_models["transformer"], provider="cuda", device_search=True, cuda_graphs=True)
    assert engine.model.capture.enabled, engine.model.capture.reason
    decode_beside_encoder_calls(engine, cpu["transformer"], beam, "on")
    assert engine.model.capture.captured_runs > 0 and engine.model.capture.failures == 0


def decode_beside_encoder_calls(engine: Engine, cpu_engine: Engine, beam: int, hold: str) -> None:
    """Sentences arriving 2 ms apart into ``engine``'s continuous scheduler (encoder beside the decode), each
    translated as ``cpu_engine`` translates it alone."""
    scheduler = ModelScheduler(engine, policy=BatchPolicy(max_wait_seconds=0.0, hold_ended=hold))
    assert scheduler.batching == "continuous" and scheduler._continuous._encoder is not None
    texts = [text for _ in range(4) for text in TEXTS]
    options = DecodingOptions(beam_size=beam)

    async def scenario() -> list:
        scheduler.start()
        calls = []
        for text in texts:  # arriving while the first ones decode
            calls.append(asyncio.ensure_future(translate_texts(engine.text, scheduler.submit, [text], options)))
            await asyncio.sleep(0.002)
        results = await asyncio.gather(*calls)
        await scheduler.close(timeout=10)
        return results

    for got, expected in zip(asyncio.run(scenario()), cpu_engine.translate(texts, options), strict=True):
        assert got[0].hypotheses[0].token_ids == expected.hypotheses[0].token_ids
        assert got[0].hypotheses[0].score == pytest.approx(expected.hypotheses[0].score, abs=TOLERANCE)


def test_two_versions_translating_concurrently_match_one_after_the_other(tiny_models, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(tiny_models["transformer"], copy)
    engines = [Engine.load(path, provider="cuda") for path in (tiny_models["transformer"], copy)]
    options = DecodingOptions(beam_size=4, num_hypotheses=2, return_attention=True)

    def run(engine: Engine) -> list:
        return [[(h.token_ids, round(h.score, 4)) for h in t.hypotheses] for t in engine.translate(TEXTS, options)]

    sequential = [run(engine) for engine in engines]
    with ThreadPoolExecutor(2) as pool:
        for _ in range(5):
            assert list(pool.map(run, engines)) == sequential


@pytest.fixture(scope="module")
def fp16(tiny_runs, tmp_path_factory) -> Iterator[Path]:
    from export.options import ExportOptions
    from export.pipeline import export_model

    result = export_model(ExportOptions(stage_processes=False,
                                        checkpoint=str(tiny_runs["transformer"]), name="tiny-fp16",
                                        model_repository=str(tmp_path_factory.mktemp("fp16")), precision="fp16",
                                        parity_sentences=4, bleu_sentences=12, progress=False))
    yield result.version_dir


def test_fp16_runs_on_cuda_like_fp32(fp16, gpu):
    engine = Engine.load(fp16, provider="cuda")
    assert engine.manifest.precision == "fp16" and engine.provider == CUDA
    options = DecodingOptions(beam_size=4, num_hypotheses=1, return_attention=True)
    same = sum(a.hypotheses[0].token_ids == b.hypotheses[0].token_ids
               for a, b in zip(engine.translate(TEXTS, options), gpu["transformer"].translate(TEXTS, options),
                               strict=True))
    assert same >= len(TEXTS) - 1


def test_fp16_every_node_but_shape_arithmetic_runs_on_cuda(fp16, tmp_path):
    assert _off_cuda(fp16, tmp_path) == (set(), set())


def test_an_int8_version_is_refused_on_cuda(tiny_runs, tmp_path):
    from common.errors import NmtError
    from export.options import ExportOptions
    from export.pipeline import export_model

    result = export_model(ExportOptions(stage_processes=False,
                                        checkpoint=str(tiny_runs["transformer"]), name="tiny-int8",
                                        model_repository=str(tmp_path), quantize="int8", parity_sentences=2,
                                        bleu_sentences=4, progress=False))
    with pytest.raises(NmtError, match="int8 version cannot run on CUDA"):
        Engine.load(result.version_dir, provider="cuda")
