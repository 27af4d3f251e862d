"""The model format both sides share: what training and export write, what the server reads.

No torch and no onnxruntime here, so the serving install imports it freely:

* :mod:`common.model_format.layout`: every file name of a training run directory and of a model version,
  and how versions are found and numbered in a model repository;
* :mod:`common.model_format.manifest`: ``manifest.json`` and the graph I/O contract it describes;
* :mod:`common.model_format.tokenizer`: the SentencePiece tokenizer and the special token ids;
* :mod:`common.model_format.decoding`: the length and scoring rules every search implements.
"""
