"""PyTorch translation models behind one small interface (see :mod:`export.models.base`)."""

from export.models.base import DecoderState, EncoderOutput, Seq2SeqModel, build_model, load_checkpoint

__all__ = ["DecoderState", "EncoderOutput", "Seq2SeqModel", "build_model", "load_checkpoint"]
