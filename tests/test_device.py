"""The GPU path's CPU-checkable parts: the provider reported is the one the sessions got, an explicit ``cuda``
that cannot run fails at start-up, ``max_length`` stays within the position table, no device buffer outlives
its batch, and an out-of-memory batch fails alone with RESOURCE_EXHAUSTED.

CUDA "available but not runnable" is reproduced as ONNX Runtime's CPU build sees it when
``get_available_providers()`` lists CUDA: the sessions are created with CUDA first and silently get the CPU,
exactly what ``onnxruntime-gpu`` does when libcudnn or libcublas is missing.
"""

from __future__ import annotations

import asyncio
import gc
import logging
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import onnxruntime as ort
import pytest
from grpc_health.v1 import health_pb2

from common.errors import NmtError
from server.core.process import open_repository
from server.engine.device import CPU, CUDA, DeviceSettings, is_out_of_memory, log_runtime, probe_provider, provider_list
from server.engine.engine import DeviceStepModel, Engine, OnnxStepModel
from server.errors import InvalidArgument
from server.frontend.app import TranslationServer
from server.frontend.validation import resolve_options
from server.protos import pb2
from server.types import DecodingOptions, RequestedOptions
from tests.harness import ServerHarness
from tests.test_server import MODEL, TEXTS, test_config, wrapping_loader

# what ONNX Runtime's BFCArena says when an arena cannot grow (onnxruntime/core/framework/bfc_arena.cc)
ORT_OUT_OF_MEMORY = ("[ONNXRuntimeError] : 6 : RUNTIME_EXCEPTION : Non-zero status code returned while running "
                     "MatMul node. Status Message: BFCArena::AllocateRawInternal Failed to allocate memory for "
                     "requested buffer of size 1073741824")


@pytest.fixture
def cuda_listed(monkeypatch: pytest.MonkeyPatch) -> None:
    """This CPU build of ONNX Runtime lists CUDA, as onnxruntime-gpu does without its CUDA libraries."""
    if CUDA in ort.get_available_providers():
        pytest.skip("this onnxruntime build has CUDA: the fallback is reproduced on the CPU build")
    monkeypatch.setattr(ort, "get_available_providers", lambda: [CUDA, CPU])


@pytest.fixture
def server_log() -> Any:
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logger = logging.getLogger("nmt.server")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    yield records
    logger.removeHandler(handler)
    logger.setLevel(level)


@pytest.mark.usefixtures("cuda_listed")
def test_auto_reports_the_cpu_it_got_and_logs_why(tiny_models, server_log):
    engine = Engine.load(tiny_models["transformer"], provider="auto", intra_op_threads=1)
    assert provider_list(DeviceSettings("auto"))[0][0] == CUDA  # CUDA was asked for...
    assert engine.provider == CPU and engine.device == "cpu"  # ...and the CPU is reported
    assert type(engine.model) is OnnxStepModel  # not a DeviceStepModel("cuda") that fails every request
    assert engine.translate(["one two"])[0].hypotheses
    fallbacks = [r for r in server_log if "serving on the CPU" in r.getMessage()]
    assert fallbacks and "no CUDA provider" in fallbacks[0].fields["reason"]


@pytest.mark.usefixtures("cuda_listed")
def test_explicit_cuda_fails_fast_naming_the_reason(tiny_models, repository):
    with pytest.raises(NmtError, match="cuda requested but the sessions run on CPUExecutionProvider: .*no CUDA"):
        Engine.load(tiny_models["transformer"], provider="cuda")
    with pytest.raises(NmtError, match="cuda requested"):
        probe_provider(DeviceSettings("cuda"))
    server = TranslationServer(test_config(repository, provider="cuda"), opener=open_repository)  # probed at start
    with pytest.raises(NmtError, match="cuda requested"):
        asyncio.run(server.start())
    assert server.repository is None  # failed before loading any model


def test_unknown_provider_is_refused(tiny_models):
    with pytest.raises(NmtError, match="unknown execution provider 'tpu'"):
        Engine.load(tiny_models["transformer"], provider="tpu")


def test_cuda_options_reach_every_session():
    providers = provider_list(DeviceSettings("cuda", device_id=1, gpu_mem_limit=2 << 30, cuda_tf32=False))
    assert providers == [(CUDA, {"device_id": "1", "arena_extend_strategy": "kSameAsRequested", "use_tf32": "0",
                                 "gpu_mem_limit": str(2 << 30)}), CPU]
    assert provider_list(DeviceSettings("cpu")) == [CPU]


def test_max_length_over_the_position_table_is_refused():
    config = test_config(Path("."))
    limit = 64
    with pytest.raises(InvalidArgument, match="over this model's 64 target positions"):
        resolve_options(RequestedOptions(max_length=limit + 1), {}, config, max_positions=limit)
    assert resolve_options(RequestedOptions(max_length=limit), {}, config, max_positions=limit).max_length == limit
    assert resolve_options(RequestedOptions(), {"max_length": 256}, config, max_positions=limit).max_length == limit
    assert resolve_options(RequestedOptions(max_length=500), {}, config, max_positions=0).max_length == 500  # RNN


def test_the_server_refuses_max_length_beyond_max_positions(repository):
    h = ServerHarness(test_config(repository), wrapping_loader(lambda e: e))
    try:
        positions = h.model_version().max_positions
        assert positions == h.engine().max_positions > 0
        request = pb2.TranslateRequest(texts=["one"], options=pb2.DecodingOptions(max_length=positions + 1))
        with pytest.raises(grpc.RpcError) as error:
            h.stub.Translate(request, timeout=30)
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        ok = pb2.TranslateRequest(texts=["one"], options=pb2.DecodingOptions(max_length=positions))
        assert h.stub.Translate(ok, timeout=30).translations[0].hypotheses[0].text
        info = h.stub.ListModels(pb2.ListModelsRequest(), timeout=10).models[0]
        assert (info.execution_provider, info.device) == (CPU, "cpu")
        assert ort.__version__ in info.onnxruntime_build
    finally:
        h.close()


@pytest.mark.parametrize("arch", ["transformer", "bahdanau"])
def test_no_device_buffer_outlives_its_batch(arch, tiny_models):
    """Device buffers (``OrtValue``) of a finished batch are freed: only the cached top_k feeds stay."""
    engine = Engine.load(tiny_models[arch], provider="cpu", intra_op_threads=1, device_state=True)
    model = engine.model
    assert isinstance(model, DeviceStepModel) and model.gather_sessions  # created at load, not in a request

    def live() -> int:
        gc.collect()
        return sum(type(o) is ort.OrtValue for o in gc.get_objects())

    others = live()  # other engines' cached top_k feeds, when earlier tests' engines are still alive
    for beam in (1, 4):
        options = DecodingOptions(beam_size=beam, num_hypotheses=1, return_attention=True)
        engine.translate(TEXTS, options)
        before = live()
        engine.translate(TEXTS, options)
        assert live() == before == others + len(model._top_k_values)


class OutOfMemoryOverTwoRows:
    """The real engine whose decoder step fails like ONNX Runtime's arena when a batch has over two rows."""

    def __init__(self, engine: Engine) -> None:
        for entry in ("step", "greedy_steps"):  # the general step and the plain greedy one
            setattr(engine.model, entry, self._limited(getattr(engine.model, entry)))
        self.engine = engine

    @staticmethod
    def _limited(step: Any) -> Any:
        def limited(tokens: np.ndarray, *args: Any, **kwargs: Any) -> Any:
            if tokens.shape[0] > 2:
                raise RuntimeError(ORT_OUT_OF_MEMORY)
            return step(tokens, *args, **kwargs)
        return limited

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)


def test_out_of_device_memory_fails_the_batch_with_resource_exhausted(repository):
    assert is_out_of_memory(RuntimeError(ORT_OUT_OF_MEMORY)) and not is_out_of_memory(RuntimeError("bad shape"))
    h = ServerHarness(test_config(repository), wrapping_loader(OutOfMemoryOverTwoRows))
    try:
        options = pb2.DecodingOptions(beam_size=1)
        with pytest.raises(grpc.RpcError) as error:
            h.stub.Translate(pb2.TranslateRequest(texts=TEXTS[:3], options=options), timeout=30)
        assert error.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "memory exhausted" in error.value.details()
        assert h.scheduler().failures == 0  # not counted against the engine
        small = h.stub.Translate(pb2.TranslateRequest(texts=TEXTS[:1], options=options), timeout=30)
        assert small.translations[0].hypotheses[0].text
        status = h.health.Check(health_pb2.HealthCheckRequest(service=MODEL), timeout=10).status
        assert status == health_pb2.HealthCheckResponse.SERVING
    finally:
        h.close()


def test_start_up_logs_the_onnxruntime_build(server_log):
    log_runtime()
    record = next(r for r in server_log if r.getMessage() == "onnxruntime")
    assert ort.__version__ in record.fields["onnxruntime"] and ort.get_device() in record.fields["onnxruntime"]
    assert record.fields["available_providers"] == ort.get_available_providers()


def test_device_flags_and_environment():
    from server.config import ServerConfig

    config = ServerConfig.from_env({"NMT_GPU_MEM_LIMIT": str(1 << 30), "NMT_DEVICE_ID": "1", "NMT_CUDA_TF32": "true"})
    assert (config.gpu_mem_limit, config.device_id, config.cuda_tf32) == (1 << 30, 1, True)
    with pytest.raises(NmtError, match="gpu_mem_limit must not be negative"):
        ServerConfig(gpu_mem_limit=-1).validate()
