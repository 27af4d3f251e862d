"""Hugging Face many-to-many directories: M2M-100 and NLLB-200 (``M2M100ForConditionalGeneration``) and mBART-50
(``MBartForConditionalGeneration``), the export pipeline's loader stage for them.

What these models share, and the import rebuilds as a :class:`Transformer`: pre-norm layers with a layer norm
after each stack, scaled embeddings shared by both sides and the output projection, the source language as the
source's first token and the target language as the decoder's forced first token (``generate``'s
``forced_bos_token_id``), after the decoder start (EOS). Where they differ: M2M-100 and NLLB read fairseq's
sinusoidal table from row ``pad + 1`` on; mBART has a learned table per side (from row 2 on) and a layer norm over
the embeddings. The tokenizer is stored as ``transformers`` runs it: NLLB's and mBART-50's ``tokenizer.json``
(``tokenizers``), M2M-100's SentencePiece model and ``vocab.json`` with its language tokens. NLLB's legacy token
placement (``legacy_behaviour: true``: the source language after EOS) is read from the tokenizer's settings and
recorded (``source_language_token: end``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from common.errors import NmtError
from common.model_format.layout import HF_TOKENIZER_FILE, MARIAN_CONFIG
from common.model_format.tokenizer import AnyTokenizer, HfTokenizer, MarianTokenizer
from export.huggingface import HfImport, load_weights, read_config
from training.models.transformer import ACTIVATIONS, Transformer, TransformerConfig, hf_state_dict, position_table

# model_type -> (transformers class name, position encoding, embedding norm)
FAMILIES = {"m2m_100": ("M2M100ForConditionalGeneration", "fairseq", False),
            "mbart": ("MBartForConditionalGeneration", "learned", True)}
LEARNED_OFFSET = 2  # mBART's learned tables: a token at position i reads row i + 2
M2M100_SPM = "sentencepiece.bpe.model"
SPECIAL_PIECES = ("<s>", "<pad>", "</s>", "<unk>", "<mask>")
# generation settings the engine has no counterpart for, and the value it supports
FIXED_FIELDS = {"no_repeat_ngram_size": 0, "repetition_penalty": 1.0, "do_sample": False}


def multilingual_config(config: dict[str, Any], where: str) -> TransformerConfig:
    """The :class:`TransformerConfig` of an M2M-100/NLLB or mBART ``config.json``; an unsupported field raises."""
    model_type = config.get("model_type")
    _, positions, embedding_norm = FAMILIES[model_type]
    for name, supported in FIXED_FIELDS.items():
        if name in config and config[name] != supported:
            raise NmtError(f"{where}: {name}={json.dumps(config[name])} is not supported "
                           f"(only {json.dumps(supported)})")
    for encoder, decoder in (("encoder_attention_heads", "decoder_attention_heads"),
                             ("encoder_ffn_dim", "decoder_ffn_dim")):
        if config.get(encoder) != config.get(decoder):
            raise NmtError(f"{where}: {encoder}={config.get(encoder)} differs from {decoder}={config.get(decoder)}; "
                           "only equal encoder and decoder sizes are supported")
    activation = config.get("activation_function", "relu")
    if activation not in ACTIVATIONS:
        raise NmtError(f"{where}: activation_function {activation!r} is not supported; choose {', '.join(ACTIVATIONS)}")
    try:
        eos = int(config["eos_token_id"])
        return TransformerConfig(
            vocab_size=int(config["vocab_size"]), d_model=int(config["d_model"]),
            encoder_layers=int(config["encoder_layers"]), decoder_layers=int(config["decoder_layers"]),
            heads=int(config["encoder_attention_heads"]), ffn_dim=int(config["encoder_ffn_dim"]), dropout=0.0,
            activation=activation, max_positions=int(config.get("max_position_embeddings", 1024)),
            scale_embedding=bool(config.get("scale_embedding", False)),
            tie_embeddings=bool(config.get("tie_word_embeddings", True)), pad_id=int(config["pad_token_id"]),
            bos_id=int(config.get("bos_token_id", 0)), eos_id=eos,
            decoder_start_id=int(config.get("decoder_start_token_id", eos)),
            pre_norm=True, embedding_norm=embedding_norm, position_encoding=positions,
        )
    except (KeyError, TypeError, ValueError) as error:
        raise NmtError(f"{where}: missing or bad field {error}") from error


def load_tokenizer_and_languages(directory: Path) -> tuple[AnyTokenizer, dict[str, int], str, bool]:
    """The directory's tokenizer as this project runs it, each language code's token id, the default source
    language and whether the source code follows EOS (NLLB's ``legacy_behaviour``), read through ``transformers``'
    own tokenizer of the directory."""
    from transformers import AutoTokenizer

    try:
        reference = AutoTokenizer.from_pretrained(directory)
    except Exception as error:
        raise NmtError(f"cannot load the tokenizer of {directory}: {error}") from error
    name = type(reference).__name__
    if name == "M2M100Tokenizer":  # SentencePiece and vocab.json, the __xx__ language tokens after it
        tokens = {code: int(i) for code, i in reference.lang_code_to_id.items()}
        spm_model = (directory / M2M100_SPM).read_bytes()
        vocab = {str(piece): int(i) for piece, i in reference.get_vocab().items()}
        tokenizer: AnyTokenizer = MarianTokenizer(spm_model, spm_model, vocab)
    elif (directory / HF_TOKENIZER_FILE).is_file() or name.endswith(("NllbTokenizer", "MBart50Tokenizer")):
        codes = [str(t) for t in reference.all_special_tokens if str(t) not in SPECIAL_PIECES]
        tokens = {code: int(reference.convert_tokens_to_ids(code)) for code in codes}
        tokenizer = HfTokenizer(reference.backend_tokenizer.to_str())
    else:
        raise NmtError(f"{directory}: tokenizer {name} is not supported (M2M100Tokenizer, NllbTokenizer and "
                       "MBart50Tokenizer are)")
    if not tokens:
        raise NmtError(f"{directory}: the tokenizer has no language tokens")
    default = str(getattr(reference, "src_lang", "") or next(iter(tokens)))
    return tokenizer, tokens, default, bool(getattr(reference, "legacy_behaviour", False))


def load_multilingual(directory: str | Path) -> HfImport:
    """Rebuild an M2M-100/NLLB-200 or mBART-50 directory as a :class:`Transformer` with its tokenizer, defaults
    and languages (``origin["languages"]``: code -> token id; ``origin["default_source"]``;
    ``origin["source_language_token"]``: "end" for NLLB's legacy placement, after EOS)."""
    directory = Path(directory)
    where = str(directory / MARIAN_CONFIG)
    config = read_config(directory)
    cfg = multilingual_config(config, where)
    tokenizer, languages, default_source, legacy = load_tokenizer_and_languages(directory)
    if tokenizer.vocab_size > cfg.vocab_size:
        raise NmtError(f"the tokenizer of {directory} has {tokenizer.vocab_size} ids but {where} says "
                       f"vocab_size={cfg.vocab_size}")
    with torch.device("meta"):
        model = Transformer(cfg)
    weights = load_weights(directory)
    state = hf_state_dict(weights, learned_offset=LEARNED_OFFSET if cfg.position_encoding == "learned" else None)
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    allowed = {"final_logits_bias"} | ({"lm_head.weight"} if cfg.tie_embeddings else set())
    missing = [name for name in missing if name not in allowed]
    if missing or unexpected:
        raise NmtError(f"weights of {directory} do not match {where}: missing {missing[:5]}, unexpected "
                       f"{unexpected[:5]}")
    del state
    if cfg.tie_embeddings:
        model.lm_head.weight = model.shared.weight
    if "final_logits_bias" not in weights and "model.final_logits_bias" not in weights:
        model.final_logits_bias = torch.zeros(1, cfg.vocab_size)  # M2M-100 has none
    model.positions = position_table(cfg)  # not stored: computed (a learned table is each stack's own)
    model.float()
    model.eval()
    defaults = {key: config[name] for key, name in (("beam_size", "num_beams"), ("length_penalty", "length_penalty"),
                                                     ("max_length", "max_length")) if config.get(name) is not None}
    origin = {"format": f"huggingface-{config['model_type']}", "path": str(directory.resolve()),
              "weights": next(name for name in ("model.safetensors", "pytorch_model.bin")
                              if (directory / name).is_file()),
              "class": FAMILIES[config["model_type"]][0], "languages": languages, "default_source": default_source,
              "source_language_token": "end" if legacy else ""}
    return HfImport(model, tokenizer, defaults, origin, weights)
