"""``nmt export``: a training run -> a verified ONNX model version (:mod:`export.pipeline` reads as its stages)."""
