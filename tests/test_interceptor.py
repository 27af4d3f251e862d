"""The request interceptor around server-streaming calls that their clients cancel, on a real ``grpc.aio`` server
on loopback: a cancellation that lands while gRPC is writing a message (the client has stopped reading, so the
write waits on flow control) is counted as CANCELLED at once, the in-flight count goes back to zero, and the
handler's own clean-up runs then, not whenever the garbage collector finalizes its generator."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import pytest

from server.frontend.interceptor import RequestInterceptor
from server.metrics import ServerMetrics

SERVICE = "test.Blobs"
METHOD = f"/{SERVICE}/Pour"
BLOB = b"x" * (1 << 20)  # a message far larger than HTTP/2's flow-control window: the second write waits


def _identity(data: bytes) -> bytes:
    return data


def _handled(metrics: ServerMetrics, code: str) -> float:
    return metrics.registry.get_sample_value(
        "grpc_server_handled_total",
        {"grpc_type": "SERVER_STREAMING", "grpc_service": SERVICE, "grpc_method": "Pour", "grpc_code": code}) or 0.0


@pytest.mark.parametrize("interceptor_service", [SERVICE, "translation.v1.Translator"],
                         ids=["accounted", "other-service"])
def test_a_stream_cancelled_while_its_message_is_written_is_counted_cancelled_at_once(interceptor_service: str) -> None:
    metrics = ServerMetrics()
    closed: list[str] = []

    async def pour(request: bytes, context: Any) -> Any:
        try:
            while True:
                yield BLOB
        finally:
            closed.append("closed")

    async def scenario() -> dict[str, Any]:
        interceptor = RequestInterceptor(metrics, service=interceptor_service)
        server = grpc.aio.server(interceptors=[interceptor])
        handler = grpc.unary_stream_rpc_method_handler(pour, request_deserializer=_identity,
                                                       response_serializer=_identity)
        server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(SERVICE, {"Pour": handler})])
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                call = channel.unary_stream(METHOD, request_serializer=_identity, response_deserializer=_identity)(
                    b"", timeout=30)
                assert await call.read() == BLOB
                await asyncio.sleep(0.2)  # the server's next write waits for the window the client does not open
                call.cancel()
                for _ in range(200):  # up to 2 s
                    if _handled(metrics, "CANCELLED") and closed:
                        break
                    await asyncio.sleep(0.01)
            return {"cancelled": _handled(metrics, "CANCELLED"), "internal": _handled(metrics, "INTERNAL"),
                    "inflight": metrics.registry.get_sample_value("nmt_inflight_requests"), "closed": list(closed)}
        finally:
            await server.stop(None)

    seen = asyncio.run(scenario())
    assert seen["cancelled"] == 1 and seen["internal"] == 0, seen
    assert seen["closed"] == ["closed"], "the handler's generator was closed when the call ended"
    if interceptor_service == SERVICE:  # an accounted, translating method: in flight while it runs
        assert seen["inflight"] == 0
