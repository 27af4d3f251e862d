"""A small Hugging Face Marian (OPUS-MT layout) model directory built offline, for the import tests.

Source and target SentencePiece models and a shared ``vocab.json`` in Marian's id layout (``</s>`` 0,
``<unk>`` 1, ``<pad>`` last = decoder start; ``>>deu<<`` and ``>>nld<<`` as in a multilingual model),
a ``MarianMTModel`` trained for a few hundred steps on the dates corpus so EOS, lengths and beams
behave as in a real model, all saved with ``save_pretrained``.
"""

from __future__ import annotations

import functools
import io
import json
from pathlib import Path

import sentencepiece as spm
import torch
import torch.nn.functional as F

from training.data import generate_dates_corpus

SIZE = dict(d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
            encoder_ffn_dim=128, decoder_ffn_dim=128)
TRAIN_SENTENCES, HELD_OUT = 3000, 20
MODEL = "opus-dates"  # its name in the test repository
LANGUAGES = ("deu", "nld")  # target-language tokens in the vocabulary (never trained on: served as transformers does)


def _spm(texts: list[str], vocab_size: int) -> bytes:
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(texts), model_writer=model, vocab_size=vocab_size,
                                   hard_vocab_limit=False, model_type="unigram", character_coverage=1.0,
                                   unk_id=1, eos_id=0, bos_id=-1, pad_id=-1, num_threads=1, minloglevel=2)
    return model.getvalue()


@functools.cache
def dates_split() -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """(training pairs, 20 held-out pairs) of the dates corpus (built once: do not modify the lists)."""
    pairs = [(p.source, p.target) for p in generate_dates_corpus(TRAIN_SENTENCES + 200, seed=7)]
    held_out = [pair for pair in pairs[TRAIN_SENTENCES:] if pair not in pairs[:TRAIN_SENTENCES]]
    return pairs[:TRAIN_SENTENCES], held_out[:HELD_OUT]


def held_out() -> list[str]:
    """The 20 held-out sources."""
    return [source for source, _ in dates_split()[1]]


def write_tokenizer_files(directory: Path, extra_pieces: tuple[str, ...] = ()) -> list[str]:
    """Write ``source.spm``, ``target.spm`` (trained on the dates corpus) and the shared ``vocab.json`` into
    ``directory``; returns the vocabulary's pieces in id order. The vocabulary holds both models' pieces, so,
    as in a real OPUS-MT vocabulary, many are unknown to ``target.spm`` (English ones); ``extra_pieces``, in
    neither model, go before ``<pad>``."""
    train, _ = dates_split()
    directory.mkdir(parents=True, exist_ok=True)
    source_proto = _spm([s for s, _ in train], 200)
    target_proto = _spm([t for _, t in train], 200)
    (directory / "source.spm").write_bytes(source_proto)
    (directory / "target.spm").write_bytes(target_proto)
    pieces: list[str] = ["</s>", "<unk>", *(f">>{code}<<" for code in LANGUAGES)]  # as opus-mt-en-mul
    for proto in (source_proto, target_proto):
        sp = spm.SentencePieceProcessor(model_proto=proto)
        pieces += [p for p in (sp.id_to_piece(i) for i in range(sp.get_piece_size())) if p not in pieces]
    pieces += [p for p in extra_pieces if p not in pieces]
    pieces.append("<pad>")
    (directory / "vocab.json").write_text(json.dumps({p: i for i, p in enumerate(pieces)}, ensure_ascii=False))
    return pieces


def build_marian_dir(directory: Path, steps: int = 300, activation: str = "swish") -> Path:
    """Train and save the Marian directory (``config.json``, ``model.safetensors``, tokenizer files)."""
    from transformers import MarianConfig, MarianMTModel, MarianTokenizer

    train, _ = dates_split()
    pieces = write_tokenizer_files(directory)
    tokenizer = MarianTokenizer(str(directory / "source.spm"), str(directory / "target.spm"),
                                str(directory / "vocab.json"), source_lang="en", target_lang="de")
    pad = len(pieces) - 1
    config = MarianConfig(vocab_size=len(pieces), pad_token_id=pad, decoder_start_token_id=pad, eos_token_id=0,
                          max_position_embeddings=128, activation_function=activation, dropout=0.0,
                          attention_dropout=0.0, activation_dropout=0.0, scale_embedding=True, **SIZE)
    torch.manual_seed(0)
    model = MarianMTModel(config)
    embeddings = model.get_input_embeddings().weight
    with torch.no_grad():  # as in OPUS-MT (and as CTranslate2 assumes): decoding starts from a zero embedding
        embeddings[pad].zero_()
    embeddings.register_hook(lambda grad: grad.index_fill(0, torch.tensor([pad]), 0.0))
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    generator = torch.Generator().manual_seed(0)
    model.train()
    for _ in range(steps):
        batch = [train[i] for i in torch.randint(len(train), (64,), generator=generator).tolist()]
        encoded = tokenizer([s for s, _ in batch], text_target=[t for _, t in batch], padding=True,
                            return_tensors="pt")
        labels = encoded["labels"].masked_fill(encoded["labels"] == pad, -100)
        logits = model(input_ids=encoded["input_ids"], attention_mask=encoded["attention_mask"],
                       labels=labels).logits
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()
    model.generation_config.bad_words_ids = [[pad]]
    model.generation_config.num_beams = 4
    model.generation_config.max_length = 64
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory
