"""Hugging Face Marian (OPUS-MT) directories, both ways.

* :func:`load_marian`: the export pipeline's loader stage for a Marian directory. It reads
  ``config.json`` (and ``generation_config.json``), refuses what :class:`Transformer` cannot run by
  naming the field, loads the weights with safe loaders only (``safetensors``, or
  ``torch.load(weights_only=True)``) and the tokenizer (:class:`MarianTokenizer`), and checks the
  rebuilt model's logits against ``transformers.MarianMTModel`` itself.
* :func:`write_marian`: ``nmt export --to huggingface``: one of our Transformers as a Marian directory
  that ``MarianMTModel``/``MarianTokenizer.from_pretrained`` and CTranslate2's ``TransformersConverter`` load.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from common.errors import NmtError
from common.model_format.layout import MARIAN_CONFIG, MARIAN_SOURCE_SPM, MARIAN_TARGET_SPM, MARIAN_VOCAB
from common.model_format.tokenizer import AnyTokenizer, MarianTokenizer, Tokenizer
from training.models.transformer import (
    ACTIVATIONS,
    Transformer,
    TransformerConfig,
    hf_state_dict,
    sinusoidal_positions,
)

GENERATION_FILE = "generation_config.json"
WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
SUPPRESSED_LOGIT = -1e4  # bad_words_ids of one token: baked into final_logits_bias (exp underflows to 0)
# config.json (or generation_config.json) fields the import has no counterpart for, and the value it supports
FIXED_FIELDS = {"normalize_before": False, "normalize_embedding": False, "add_final_layer_norm": False,
                "static_position_embeddings": True, "share_encoder_decoder_embeddings": True,
                "add_bias_logits": False, "no_repeat_ngram_size": 0, "repetition_penalty": 1.0, "do_sample": False}
PAIRED_FIELDS = (("encoder_attention_heads", "decoder_attention_heads"), ("encoder_ffn_dim", "decoder_ffn_dim"))


@dataclass
class HfImport:
    """What a Hugging Face directory's loader (Marian here, the many-to-many ones in :mod:`export.hf_multilingual`)
    hands the pipeline."""

    model: Transformer
    tokenizer: AnyTokenizer
    defaults: dict[str, Any]  # beam_size, length_penalty, max_length from the model's generation settings
    origin: dict[str, Any]  # recorded in the manifest
    state: dict[str, torch.Tensor]  # the weights as the files name them; the model holds these same tensors


def read_config(directory: Path) -> dict[str, Any]:
    """``config.json`` with ``generation_config.json``'s values over it (where transformers 5 keeps them)."""
    config: dict[str, Any] = {}
    for name in (MARIAN_CONFIG, GENERATION_FILE):
        path = directory / name
        if path.is_file():
            try:
                config.update(json.loads(path.read_text(encoding="utf-8")))
            except (UnicodeDecodeError, json.JSONDecodeError) as error:
                raise NmtError(f"cannot read {path}: {error}") from error
    return config


def transformer_config(config: dict[str, Any], where: str) -> TransformerConfig:
    """The :class:`TransformerConfig` of a Marian ``config.json``; an unsupported field raises, named."""
    if config.get("model_type") != "marian":
        raise NmtError(f"{where}: model_type {config.get('model_type')!r} is not supported; Hugging Face Marian "
                       "(marian: the OPUS-MT models), M2M-100 and NLLB-200 (m2m_100) and mBART-50 (mbart) import")
    for name, supported in FIXED_FIELDS.items():
        if name in config and config[name] != supported:
            raise NmtError(f"{where}: {name}={json.dumps(config[name])} is not supported "
                           f"(only {json.dumps(supported)})")
    for encoder, decoder in PAIRED_FIELDS:
        if config.get(encoder) != config.get(decoder):
            raise NmtError(f"{where}: {encoder}={config.get(encoder)} differs from {decoder}={config.get(decoder)}; "
                           "only equal encoder and decoder sizes are supported")
    vocab = config.get("vocab_size")
    if config.get("decoder_vocab_size") not in (None, vocab):
        raise NmtError(f"{where}: decoder_vocab_size={config['decoder_vocab_size']} differs from vocab_size={vocab}")
    activation = config.get("activation_function", "gelu")
    if activation not in ACTIVATIONS:
        raise NmtError(f"{where}: activation_function {activation!r} is not supported; choose "
                       f"{', '.join(ACTIVATIONS)}")
    try:
        start = int(config.get("decoder_start_token_id", config["pad_token_id"]))
        return TransformerConfig(
            vocab_size=int(vocab), d_model=int(config["d_model"]), encoder_layers=int(config["encoder_layers"]),
            decoder_layers=int(config["decoder_layers"]), heads=int(config["encoder_attention_heads"]),
            ffn_dim=int(config["encoder_ffn_dim"]), dropout=0.0, activation=activation,
            max_positions=int(config.get("max_position_embeddings", 512)),
            scale_embedding=bool(config.get("scale_embedding", False)),
            tie_embeddings=bool(config.get("tie_word_embeddings", True)), pad_id=int(config["pad_token_id"]),
            bos_id=start, eos_id=int(config["eos_token_id"]), decoder_start_id=start,
        )
    except (KeyError, TypeError, ValueError) as error:
        raise NmtError(f"{where}: missing or bad field {error}") from error


def load_weights(directory: Path) -> dict[str, torch.Tensor]:
    """The state dict, from ``model.safetensors`` or ``pytorch_model.bin`` (``weights_only=True``)."""
    for name in WEIGHT_FILES:
        path = directory / name
        if not path.is_file():
            continue
        try:
            if name.endswith(".safetensors"):
                from safetensors.torch import load_file

                # read into memory of its own (not mapped): the export frees it in place when done with the
                # model (export.sources.ExportInputs.release_model), which a mapping of the file cannot be
                return load_file(path, backend="pread")
            return torch.load(path, map_location="cpu", weights_only=True)
        except Exception as error:
            raise NmtError(f"cannot read weights {path}: {error}") from error
    raise NmtError(f"weights not found in {directory}: expected {' or '.join(WEIGHT_FILES)}")


def load_marian(directory: str | Path) -> HfImport:
    """Rebuild a Hugging Face Marian directory as a :class:`Transformer` with its tokenizer and defaults."""
    directory = Path(directory)
    where = str(directory / MARIAN_CONFIG)
    config = read_config(directory)
    cfg = transformer_config(config, where)
    with torch.device("meta"):  # no storage: the model takes the loaded tensors themselves (one copy, not two)
        model = Transformer(cfg)
    tokenizer = MarianTokenizer.load(directory)
    if tokenizer.vocab_size != cfg.vocab_size:
        raise NmtError(f"{directory / MARIAN_VOCAB} has {tokenizer.vocab_size} ids but {where} says "
                       f"vocab_size={cfg.vocab_size}")
    weights = load_weights(directory)
    state = hf_state_dict(weights)
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    missing = [name for name in missing if not (name == "lm_head.weight" and cfg.tie_embeddings)]
    if missing or unexpected:
        raise NmtError(f"weights of {directory} do not match {where}: missing {missing[:5]}, unexpected "
                       f"{unexpected[:5]}")
    del state
    if cfg.tie_embeddings:  # assign replaced the shared table: the output projection is it again
        model.lm_head.weight = model.shared.weight
    model.positions = sinusoidal_positions(cfg.max_positions, cfg.d_model)  # not stored: computed
    model.float()  # a checkpoint stored in half precision is exported from fp32, as before (no copy when fp32)
    suppressed = _suppressed_ids(config.get("bad_words_ids"), where)
    with torch.no_grad():
        model.final_logits_bias[0, suppressed] = SUPPRESSED_LOGIT
    model.eval()
    defaults = {key: config[name] for key, name in (("beam_size", "num_beams"), ("length_penalty", "length_penalty"),
                                                     ("max_length", "max_length")) if config.get(name) is not None}
    origin = {"format": "huggingface-marian", "path": str(directory.resolve()),
              "weights": next(name for name in WEIGHT_FILES if (directory / name).is_file()),
              "suppressed_ids": suppressed, "target_languages": tokenizer.target_languages}
    return HfImport(model, tokenizer, defaults, origin, weights)


def _suppressed_ids(bad_words_ids: Any, where: str) -> list[int]:
    """The ids of ``bad_words_ids`` (one-token sequences only, such as Marian's ``[[pad]]``)."""
    if not bad_words_ids:
        return []
    if not all(isinstance(words, list) and len(words) == 1 for words in bad_words_ids):
        raise NmtError(f"{where}: bad_words_ids with sequences longer than one token are not supported")
    return sorted({int(words[0]) for words in bad_words_ids})


def compare_with_transformers(model: Transformer, directory: Path, sources: list[list[int]],
                              targets: list[list[int]], suppressed: list[int],
                              state: dict[str, torch.Tensor] | None = None) -> float:
    """Max |logit difference| between ``model`` and transformers' own class of ``directory``'s ``model_type``
    (``MarianMTModel``, ``M2M100ForConditionalGeneration``, ``MBartForConditionalGeneration``) loading it,
    teacher forced on ``sources`` (EOS included) and ``targets`` (logits of suppressed ids left out). With
    ``state`` (the directory's weights under its own names, already loaded: :attr:`HfImport.state`), the
    class takes those tensors with the directory's ``config.json`` instead of reading the files again: the check
    costs no second copy of the weights, and transformers still maps every name itself."""
    import transformers

    config = transformers.AutoConfig.from_pretrained(directory)
    classes = {"marian": "MarianMTModel", "m2m_100": "M2M100ForConditionalGeneration",
               "mbart": "MBartForConditionalGeneration"}
    cls = getattr(transformers, classes[config.model_type])
    if state is None:
        reference = cls.from_pretrained(directory)
    else:
        reference = cls.from_pretrained(None, config=config, state_dict=state)
    reference = reference.float().eval()
    cfg = model.config
    worst = 0.0
    keep = torch.ones(cfg.vocab_size, dtype=torch.bool)
    keep[suppressed] = False
    with torch.no_grad():
        for source, target in zip(sources, targets, strict=True):
            src = torch.tensor([source])
            tgt_in = torch.tensor([[cfg.decoder_start_id, *target]])
            ours = model(src, tgt_in)[..., keep]
            theirs = reference(input_ids=src, decoder_input_ids=tgt_in).logits[..., keep]
            worst = max(worst, float((ours - theirs).abs().max()))
    return worst


def write_marian(model: Transformer, tokenizer: Tokenizer, out: str | Path, *, defaults: dict[str, Any],
                 force: bool = False) -> float:
    """Write ``model`` and its joint tokenizer as a Marian directory ``out`` (via a temporary directory,
    renamed into place); returns the max |logit difference| of ``MarianMTModel`` loading it vs ``model``."""
    from transformers import GenerationConfig, MarianConfig, MarianMTModel, MarianTokenizer

    out = Path(out)
    if out.exists() and not force:
        raise NmtError(f"{out} already exists; use --force to overwrite it")
    cfg = model.config
    config = MarianConfig(
        vocab_size=cfg.vocab_size, decoder_vocab_size=cfg.vocab_size, d_model=cfg.d_model,
        encoder_layers=cfg.encoder_layers, decoder_layers=cfg.decoder_layers, encoder_attention_heads=cfg.heads,
        decoder_attention_heads=cfg.heads, encoder_ffn_dim=cfg.ffn_dim, decoder_ffn_dim=cfg.ffn_dim,
        activation_function=cfg.activation, max_position_embeddings=cfg.max_positions,
        scale_embedding=cfg.scale_embedding, tie_word_embeddings=cfg.tie_embeddings,
        share_encoder_decoder_embeddings=True, pad_token_id=cfg.pad_id, eos_token_id=cfg.eos_id,
        forced_eos_token_id=cfg.eos_id, decoder_start_token_id=cfg.decoder_start_id, dropout=cfg.dropout,
    )
    hf_model = MarianMTModel(config).eval()
    state = {("" if name in ("lm_head.weight", "final_logits_bias") else "model.") + name: value
             for name, value in model.state_dict().items()}
    state["model.encoder.embed_tokens.weight"] = state["model.decoder.embed_tokens.weight"] = model.shared.weight
    hf_model.load_state_dict(state, strict=False)
    hf_model.generation_config = GenerationConfig(
        num_beams=defaults["beam_size"], length_penalty=defaults["length_penalty"], max_length=defaults["max_length"],
        decoder_start_token_id=cfg.decoder_start_id, eos_token_id=cfg.eos_id, forced_eos_token_id=cfg.eos_id,
        pad_token_id=cfg.pad_id,
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".{out.name}-", dir=out.parent) as tmp:
        work = Path(tmp) / "marian"
        hf_model.save_pretrained(work)
        for name in (MARIAN_SOURCE_SPM, MARIAN_TARGET_SPM):  # one joint model serves both sides
            (work / name).write_bytes(tokenizer.model_proto)
        vocab = dict(zip(tokenizer.pieces(range(tokenizer.vocab_size)), range(tokenizer.vocab_size), strict=True))
        (work / MARIAN_VOCAB).write_text(json.dumps(vocab, ensure_ascii=False, indent=1) + "\n", encoding="utf-8")
        special = {name: tokenizer.pieces([i])[0] for name, i in (("eos_token", cfg.eos_id),
                                                                  ("pad_token", cfg.pad_id))}
        MarianTokenizer(str(work / MARIAN_SOURCE_SPM), str(work / MARIAN_TARGET_SPM), str(work / MARIAN_VOCAB),
                        unk_token=tokenizer.pieces([tokenizer.unk_id])[0], **special).save_pretrained(work)
        generator = torch.Generator().manual_seed(0)
        ids = torch.randint(4, cfg.vocab_size, (4, 9), generator=generator).tolist()
        diff = compare_with_transformers(model, work, [row + [cfg.eos_id] for row in ids], ids, [])
        if out.exists():
            os.replace(out, Path(tmp) / "replaced")
        os.replace(work, out)
    return diff

