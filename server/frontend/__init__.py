"""The front-end: gRPC and HTTP faces, TLS and tokens, validation, tokenizing and detokenizing around the
decoding, responses, request logs and metrics. Never imports :mod:`server.engine`, :mod:`server.core` or
ONNX Runtime: the models are reached through a repository it is given (in one process) or through the
engine core's catalog (:mod:`server.frontend.remote`)."""
