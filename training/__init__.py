"""Corpora, the PyTorch models, the training loop and the reference search (needs the train extra)."""
