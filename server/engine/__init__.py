"""The decoding engine: ONNX Runtime sessions, the step models and the search (greedy, beam, sampling,
forced prefixes, alternatives), driven by the engine core. Never imports :mod:`server.frontend`."""
