"""PyTorch translation models: :mod:`~training.models.interface` (what every model implements), the
architectures (:mod:`~training.models.transformer`, :mod:`~training.models.bahdanau`) and
:mod:`~training.models.checkpoint` (build by name, save, load)."""
