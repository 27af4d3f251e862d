"""Small random Hugging Face many-to-many directories built offline: NLLB-200 and M2M-100
(``M2M100ForConditionalGeneration``) and mBART-50 (``MBartForConditionalGeneration``), each with a
SentencePiece model trained here and its own ``transformers`` tokenizer."""

from __future__ import annotations

import io
import json
import random
from pathlib import Path

import sentencepiece as spm

WORDS = ("the", "house", "is", "wonderful", "a", "cat", "sat", "on", "mat", "das", "Haus", "ist", "wunderbar",
         "le", "chat", "est", "sur", "tapis", "April", "May", "June", "Tuesday", "Dienstag", "mardi", "avril")
NLLB_CODES = ["eng_Latn", "deu_Latn", "fra_Latn"]
MBART_CODES = ["en_XX", "de_DE", "fr_XX"]
M2M100_CODES = ["en", "de", "fr"]  # of its 100, those the test model is trained on
SHAPE = dict(d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
             encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64)


def sentences(count: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 7))) for _ in range(count)]


def train_spm(model_type: str = "bpe", vocab_size: int = 80) -> bytes:
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(sentences(3000)), model_writer=model,
                                   vocab_size=vocab_size, model_type=model_type, minloglevel=2,
                                   hard_vocab_limit=False)
    return model.getvalue()


def _save_model(directory: Path, family: str, tokenizer: object, codes: list[str], seed: int) -> None:
    """A small model of ``family`` trained briefly to copy sentences into every language code (so its outputs end,
    as a real model's do, rather than run to the output limit), saved into ``directory``."""
    import torch
    import transformers

    torch.manual_seed(seed)
    vocab_size = max(*tokenizer.get_vocab().values(), *getattr(tokenizer, "lang_code_to_id", {}).values()) + 1
    if family == "m2m_100":
        config = transformers.M2M100Config(vocab_size=vocab_size, scale_embedding=True, activation_function="relu",
                                           pad_token_id=1, bos_token_id=0, eos_token_id=2,
                                           decoder_start_token_id=2, dropout=0.0, attention_dropout=0.0,
                                           **SHAPE)
        model = transformers.M2M100ForConditionalGeneration(config)
    else:
        config = transformers.MBartConfig(vocab_size=vocab_size, scale_embedding=True, activation_function="gelu",
                                          pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=2,
                                          dropout=0.0, attention_dropout=0.0, **SHAPE)
        model = transformers.MBartForConditionalGeneration(config)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    rng = random.Random(seed)
    texts = sentences(400, seed)
    model.train()
    for _ in range(120):  # enough for outputs that end (measured: 4 to 17 pieces, beam 4)
        source, target = rng.choice(codes), rng.choice(codes)
        tokenizer.src_lang, tokenizer.tgt_lang = source, target
        chosen = rng.sample(texts, 16)
        batch = tokenizer(chosen, return_tensors="pt", padding=True)
        tokenizer.src_lang = target  # the target side: the target code first, as generate's forced first token
        labels = tokenizer(chosen, return_tensors="pt", padding=True).input_ids
        labels[labels == config.pad_token_id] = -100
        loss = model(**batch, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval().save_pretrained(directory)


def random_nllb(directory: Path, *, d_model: int, layers: int, heads: int, ffn: int, vocab: int,
                max_positions: int, seed: int = 0) -> tuple[object, object]:
    """An NLLB-shaped random ``M2M100ForConditionalGeneration`` (not saved) and its ``NllbTokenizer`` over a
    SentencePiece model trained here (saved into ``directory``; the rest of ``vocab`` no piece of it): what the
    benchmarks build at NLLB-200's real shapes."""
    import torch
    from transformers import M2M100Config, M2M100ForConditionalGeneration, NllbTokenizer

    directory.mkdir(parents=True, exist_ok=True)
    (directory / "sentencepiece.bpe.model").write_bytes(train_spm(vocab_size=2000))
    tokenizer = NllbTokenizer.from_pretrained(directory, src_lang=NLLB_CODES[0], extra_special_tokens=NLLB_CODES)
    (directory / "sentencepiece.bpe.model").unlink()
    tokenizer.save_pretrained(directory)
    config = M2M100Config(
        vocab_size=vocab, d_model=d_model, encoder_layers=layers, decoder_layers=layers,
        encoder_attention_heads=heads, decoder_attention_heads=heads, encoder_ffn_dim=ffn, decoder_ffn_dim=ffn,
        activation_function="relu", scale_embedding=True, max_position_embeddings=max_positions, pad_token_id=1,
        bos_token_id=0, eos_token_id=2, decoder_start_token_id=2, dropout=0.0, attention_dropout=0.0,
        activation_dropout=0.0)
    torch.manual_seed(seed)
    return M2M100ForConditionalGeneration(config).eval(), tokenizer


def nllb_dir(directory: Path, seed: int = 0) -> Path:
    from transformers import NllbTokenizer

    directory.mkdir(parents=True, exist_ok=True)
    (directory / "sentencepiece.bpe.model").write_bytes(train_spm())
    tokenizer = NllbTokenizer.from_pretrained(directory, src_lang="eng_Latn", extra_special_tokens=NLLB_CODES)
    (directory / "sentencepiece.bpe.model").unlink()
    tokenizer.save_pretrained(directory)
    _save_model(directory, "m2m_100", tokenizer, NLLB_CODES, seed)
    return directory


def m2m100_dir(directory: Path, seed: int = 0) -> Path:
    from transformers import M2M100Tokenizer

    directory.mkdir(parents=True, exist_ok=True)
    proto = train_spm()
    (directory / "sentencepiece.bpe.model").write_bytes(proto)
    processor = spm.SentencePieceProcessor(model_proto=proto)
    vocab = {"<s>": 0, "<pad>": 1, "</s>": 2, "<unk>": 3}
    for i in range(processor.get_piece_size()):
        vocab.setdefault(processor.id_to_piece(i), len(vocab))
    (directory / "vocab.json").write_text(json.dumps(vocab), encoding="utf-8")
    tokenizer = M2M100Tokenizer(str(directory / "vocab.json"), str(directory / "sentencepiece.bpe.model"),
                                src_lang="en", num_madeup_words=0)
    tokenizer.save_pretrained(directory)
    _save_model(directory, "m2m_100", tokenizer, M2M100_CODES, seed)
    return directory


def mbart50_dir(directory: Path, seed: int = 0) -> Path:
    from transformers import MBart50Tokenizer

    directory.mkdir(parents=True, exist_ok=True)
    (directory / "sentencepiece.bpe.model").write_bytes(train_spm("unigram"))
    tokenizer = MBart50Tokenizer.from_pretrained(directory, src_lang="en_XX", extra_special_tokens=MBART_CODES)
    (directory / "sentencepiece.bpe.model").unlink()
    tokenizer.save_pretrained(directory)
    _save_model(directory, "mbart", tokenizer, MBART_CODES, seed)
    return directory
