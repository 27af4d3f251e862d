"""Server reflection, both versions: ``grpc.reflection.v1alpha.ServerReflection`` and ``grpc.reflection.v1``.

grpcio-reflection (up to 1.85, the newest release) implements only ``v1alpha``; newer tools (grpcurl,
Postman) ask ``v1`` first. The two services' messages are identical apart from their package, so
``v1`` is served by the library's own ``v1alpha`` servicer: each ``v1`` request is re-read as a
``v1alpha`` one (same bytes) and each answer re-read as ``v1``. The ``v1`` messages are compiled from
``proto/grpc/reflection/v1/reflection.proto`` (:func:`server.protos.compile_messages`), which also puts
the ``v1`` service's own descriptors in the pool, so reflection can describe itself in both versions.

When a grpcio-reflection with ``grpc_reflection.v1`` exists, use it instead and delete this bridge.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable
from typing import Any

import grpc
from grpc_reflection.v1alpha import reflection as v1alpha
from grpc_reflection.v1alpha import reflection_pb2 as v1alpha_pb2
from grpc_reflection.v1alpha import reflection_pb2_grpc as v1alpha_pb2_grpc

from server.protos import compile_messages

V1_PROTO = "grpc/reflection/v1/reflection.proto"
v1_pb2 = compile_messages(V1_PROTO, "server.reflection_v1_pb2")
V1_SERVICE_NAME = v1_pb2.DESCRIPTOR.services_by_name["ServerReflection"].full_name  # "grpc.reflection.v1..."
V1ALPHA_SERVICE_NAME = v1alpha.SERVICE_NAME  # "grpc.reflection.v1alpha.ServerReflection"
SERVICE_NAMES = (V1_SERVICE_NAME, V1ALPHA_SERVICE_NAME)


class V1ReflectionServicer:
    """``grpc.reflection.v1.ServerReflection`` answered by a ``v1alpha`` servicer."""

    def __init__(self, v1alpha_servicer: Any) -> None:
        self.v1alpha = v1alpha_servicer

    async def ServerReflectionInfo(  # noqa: N802 - the RPC's name
        self, request_iterator: AsyncIterator[Any], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[Any]:
        async def as_v1alpha() -> AsyncIterator[Any]:
            async for request in request_iterator:
                yield v1alpha_pb2.ServerReflectionRequest.FromString(request.SerializeToString())

        async for response in self.v1alpha.ServerReflectionInfo(as_v1alpha(), context):
            yield v1_pb2.ServerReflectionResponse.FromString(response.SerializeToString())


def enable_server_reflection(service_names: Iterable[str], server: grpc.aio.Server) -> None:
    """Serve both reflection services on ``server``; they list ``service_names`` and themselves."""
    servicer = v1alpha.aio.ReflectionServicer([*service_names, *SERVICE_NAMES])
    v1alpha_pb2_grpc.add_ServerReflectionServicer_to_server(servicer, server)
    v1 = V1ReflectionServicer(servicer)
    handler = grpc.stream_stream_rpc_method_handler(
        v1.ServerReflectionInfo,
        request_deserializer=v1_pb2.ServerReflectionRequest.FromString,
        response_serializer=v1_pb2.ServerReflectionResponse.SerializeToString,
    )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(V1_SERVICE_NAME,
                                                                          {"ServerReflectionInfo": handler}),))
