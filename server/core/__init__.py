"""The engine core: the model repository, its schedulers (static and continuous batching) and the process
that serves them to front-ends (:mod:`server.core.process`). Never imports :mod:`server.frontend`."""
