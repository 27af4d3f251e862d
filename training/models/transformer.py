"""Transformer encoder-decoder (Vaswani et al. 2017): post-layer-norm with sinusoidal positions (this project's
and Marian's), or the pre-layer-norm variants of the multilingual models (M2M-100 and NLLB-200: fairseq's
sinusoidal table; mBART: learned positions and a layer norm over the embeddings).

Parameter names follow Hugging Face's ``MarianMTModel``/``M2M100ForConditionalGeneration`` (``shared``,
``encoder.layers.N.self_attn.q_proj``, ``decoder.layers.N.encoder_attn``, ``encoder.layer_norm``, ``lm_head``,
``final_logits_bias``...) so their state dicts load with :func:`hf_state_dict` and the same weights can be
compared against other runtimes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from common.model_format.tokenizer import BOS_ID, EOS_ID, PAD_ID
from training.models.interface import DecoderState, EncoderOutput, Seq2SeqModel

ACTIVATIONS = {"relu": F.relu, "gelu": F.gelu, "silu": F.silu, "swish": F.silu}


@dataclass
class TransformerConfig:
    vocab_size: int
    d_model: int = 256
    encoder_layers: int = 3
    decoder_layers: int = 3
    heads: int = 4
    ffn_dim: int = 1024
    dropout: float = 0.1
    activation: str = "relu"
    max_positions: int = 512
    scale_embedding: bool = True
    tie_embeddings: bool = True
    pad_id: int = PAD_ID
    bos_id: int = BOS_ID
    eos_id: int = EOS_ID
    decoder_start_id: int = BOS_ID
    alignment_layer: int = -1  # decoder layer whose cross-attention (mean over heads) is returned
    pre_norm: bool = False  # layer norm before each sublayer and after each stack (M2M-100, NLLB, mBART)
    embedding_norm: bool = False  # a layer norm over each side's embeddings (mBART's layernorm_embedding)
    # "sinusoidal" (Marian's table), "fairseq" (M2M-100's: its first rows skipped, see fairseq_positions) or
    # "learned" (mBART: a table per side, stored with the weights)
    position_encoding: str = "sinusoidal"


POSITION_ENCODINGS = ("sinusoidal", "fairseq", "learned")


def sinusoidal_positions(length: int, dim: int) -> Tensor:
    """Marian layout: sines of all frequencies in the first half of the vector, cosines in the second."""
    position = torch.arange(length, dtype=torch.float64)[:, None]
    inv_freq = torch.pow(10000.0, -torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    angles = position * inv_freq[None, :]
    table = torch.zeros(length, dim, dtype=torch.float64)
    table[:, : dim // 2] = torch.sin(angles[:, : dim // 2 + dim % 2][:, : dim // 2])
    table[:, dim // 2 :] = torch.cos(angles[:, : dim - dim // 2])
    return table.float()


def fairseq_positions(length: int, dim: int, padding_id: int) -> Tensor:
    """M2M-100's (fairseq's) sinusoidal table as its models read it: sines then cosines of ``dim // 2``
    frequencies spaced over ``half - 1`` steps; a sentence's ``i``-th token reads row ``padding_id + 1 + i``,
    so the rows before that are left out here (the engine's positions start at 0)."""
    half = dim // 2
    step = math.log(10000) / (half - 1)
    inv_freq = torch.exp(torch.arange(half, dtype=torch.int64).float() * -step)
    angles = torch.arange(length + padding_id + 1, dtype=torch.int64).float()[:, None] * inv_freq[None, :]
    table = torch.cat([torch.sin(angles), torch.cos(angles)], dim=1)
    if dim % 2:
        table = torch.cat([table, torch.zeros(table.shape[0], 1)], dim=1)
    return table[padding_id + 1 :].contiguous()


def position_table(cfg: TransformerConfig) -> Tensor:
    """The computed positions table of ``cfg`` (a learned one starts as this and is loaded over)."""
    if cfg.position_encoding == "fairseq":
        return fairseq_positions(cfg.max_positions, cfg.d_model, cfg.pad_id)
    return sinusoidal_positions(cfg.max_positions, cfg.d_model)


class MultiHeadAttention(nn.Module):
    """Scaled dot-product attention with ``q/k/v/out`` projections; keys/values come pre-split by head."""

    def __init__(self, d_model: int, heads: int) -> None:
        super().__init__()
        if d_model % heads:
            raise ValueError(f"d_model {d_model} is not divisible by heads {heads}")
        self.heads, self.head_dim = heads, d_model // heads
        self.q_proj = nn.Linear(d_model, d_model)
        self.k_proj = nn.Linear(d_model, d_model)
        self.v_proj = nn.Linear(d_model, d_model)
        self.out_proj = nn.Linear(d_model, d_model)

    def split(self, x: Tensor) -> Tensor:
        """[B, L, D] -> [B, H, L, Dh]"""
        return x.view(x.shape[0], x.shape[1], self.heads, self.head_dim).transpose(1, 2)

    def forward(
        self, query: Tensor, key: Tensor, value: Tensor, mask: Tensor | None, need_weights: bool = False
    ) -> tuple[Tensor, Tensor | None]:
        """``query`` [B, Lq, D]; ``key``/``value`` [B, H, Lk, Dh]; ``mask`` bool broadcastable to
        [B, H, Lq, Lk] (True = attend). Returns output [B, Lq, D] and, if asked, weights [B, Lq, Lk]
        averaged over heads."""
        q = self.split(self.q_proj(query))
        weights = None
        if need_weights:
            scores = (q @ key.transpose(-1, -2)) / math.sqrt(self.head_dim)
            if mask is not None:
                scores = scores.masked_fill(~mask, float("-inf"))
            probs = scores.softmax(-1)
            out = probs @ value
            weights = probs.mean(1)
        else:
            out = F.scaled_dot_product_attention(q, key, value, attn_mask=mask)
        out = out.transpose(1, 2).reshape(query.shape[0], query.shape[1], -1)
        return self.out_proj(out), weights


class EncoderLayer(nn.Module):
    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__()
        self.self_attn = MultiHeadAttention(cfg.d_model, cfg.heads)
        self.self_attn_layer_norm = nn.LayerNorm(cfg.d_model)
        self.fc1 = nn.Linear(cfg.d_model, cfg.ffn_dim)
        self.fc2 = nn.Linear(cfg.ffn_dim, cfg.d_model)
        self.final_layer_norm = nn.LayerNorm(cfg.d_model)
        self.act = ACTIVATIONS[cfg.activation]
        self.dropout = nn.Dropout(cfg.dropout)
        self.pre_norm = cfg.pre_norm

    def forward(self, x: Tensor, mask: Tensor) -> Tensor:
        attn = self.self_attn
        if self.pre_norm:
            h = self.self_attn_layer_norm(x)
            h, _ = attn(h, attn.split(attn.k_proj(h)), attn.split(attn.v_proj(h)), mask)
            x = x + self.dropout(h)
            return x + self.dropout(self.fc2(self.dropout(self.act(self.fc1(self.final_layer_norm(x))))))
        h, _ = attn(x, attn.split(attn.k_proj(x)), attn.split(attn.v_proj(x)), mask)
        x = self.self_attn_layer_norm(x + self.dropout(h))
        h = self.fc2(self.dropout(self.act(self.fc1(x))))
        return self.final_layer_norm(x + self.dropout(h))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__()
        self.self_attn = MultiHeadAttention(cfg.d_model, cfg.heads)
        self.self_attn_layer_norm = nn.LayerNorm(cfg.d_model)
        self.encoder_attn = MultiHeadAttention(cfg.d_model, cfg.heads)
        self.encoder_attn_layer_norm = nn.LayerNorm(cfg.d_model)
        self.fc1 = nn.Linear(cfg.d_model, cfg.ffn_dim)
        self.fc2 = nn.Linear(cfg.ffn_dim, cfg.d_model)
        self.final_layer_norm = nn.LayerNorm(cfg.d_model)
        self.act = ACTIVATIONS[cfg.activation]
        self.dropout = nn.Dropout(cfg.dropout)
        self.pre_norm = cfg.pre_norm

    def forward(
        self,
        x: Tensor,
        past_key: Tensor,
        past_value: Tensor,
        cross_key: Tensor,
        cross_value: Tensor,
        src_mask: Tensor,
        causal_mask: Tensor | None,
        need_weights: bool,
    ) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
        """``x`` [B, T, D] new positions; ``past_*`` [B, H, P, Dh] cache (P may be 0).

        Returns (output [B, T, D], present key, present value [B, H, P+T, Dh], cross weights or None)."""
        attn = self.self_attn
        if self.pre_norm:
            h = self.self_attn_layer_norm(x)
            key = torch.cat([past_key, attn.split(attn.k_proj(h))], dim=-2)
            value = torch.cat([past_value, attn.split(attn.v_proj(h))], dim=-2)
            h, _ = attn(h, key, value, causal_mask)
            x = x + self.dropout(h)
            h, weights = self.encoder_attn(self.encoder_attn_layer_norm(x), cross_key, cross_value, src_mask,
                                           need_weights)
            x = x + self.dropout(h)
            h = self.fc2(self.dropout(self.act(self.fc1(self.final_layer_norm(x)))))
            return x + self.dropout(h), key, value, weights
        key = torch.cat([past_key, attn.split(attn.k_proj(x))], dim=-2)
        value = torch.cat([past_value, attn.split(attn.v_proj(x))], dim=-2)
        h, _ = attn(x, key, value, causal_mask)
        x = self.self_attn_layer_norm(x + self.dropout(h))
        h, weights = self.encoder_attn(x, cross_key, cross_value, src_mask, need_weights)
        x = self.encoder_attn_layer_norm(x + self.dropout(h))
        h = self.fc2(self.dropout(self.act(self.fc1(x))))
        return self.final_layer_norm(x + self.dropout(h)), key, value, weights


class Stack(nn.Module):
    """One side's layers, with what the pre-norm variants add around them: a layer norm over the embeddings
    (``layernorm_embedding``, mBART), one after the last layer (``layer_norm``) and a learned positions table
    (``embed_positions``, mBART)."""

    def __init__(self, layers: list[nn.Module], cfg: TransformerConfig) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.layernorm_embedding = nn.LayerNorm(cfg.d_model) if cfg.embedding_norm else None
        self.layer_norm = nn.LayerNorm(cfg.d_model) if cfg.pre_norm else None
        self.embed_positions = (nn.Embedding(cfg.max_positions, cfg.d_model)
                                if cfg.position_encoding == "learned" else None)

    def embedded(self, x: Tensor) -> Tensor:
        """Token embeddings plus positions, normalised where the model does."""
        return x if self.layernorm_embedding is None else self.layernorm_embedding(x)

    def finished(self, x: Tensor) -> Tensor:
        """The last layer's output, normalised where the model does."""
        return x if self.layer_norm is None else self.layer_norm(x)


class Transformer(Seq2SeqModel):
    """Encoder-decoder Transformer; decoder state holds per-layer self-attention K/V caches
    (``self_key.N``/``self_value.N`` [B, H, t, Dh]) and precomputed cross-attention K/V
    (``cross_key.N``/``cross_value.N`` [B, H, S, Dh]) plus the source mask ``src_mask`` [B, 1, 1, S]."""

    arch = "transformer"

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        self.config = cfg = config
        self.shared = nn.Embedding(cfg.vocab_size, cfg.d_model, padding_idx=cfg.pad_id)
        nn.init.normal_(self.shared.weight, std=cfg.d_model**-0.5)
        with torch.no_grad():
            self.shared.weight[cfg.pad_id].zero_()
        if cfg.position_encoding not in POSITION_ENCODINGS:
            raise ValueError(f"position_encoding {cfg.position_encoding!r} is not one of {POSITION_ENCODINGS}")
        self.encoder = Stack([EncoderLayer(cfg) for _ in range(cfg.encoder_layers)], cfg)
        self.decoder = Stack([DecoderLayer(cfg) for _ in range(cfg.decoder_layers)], cfg)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.shared.weight
        self.register_buffer("final_logits_bias", torch.zeros(1, cfg.vocab_size))
        self.register_buffer("positions", position_table(cfg), persistent=False)
        self.embed_scale = math.sqrt(cfg.d_model) if cfg.scale_embedding else 1.0
        self.dropout = nn.Dropout(cfg.dropout)

    def position_rows(self, stack: Stack) -> Tensor:
        """The positions table ``stack`` reads: its own learned one, else the shared computed one."""
        return self.positions if stack.embed_positions is None else stack.embed_positions.weight

    def embed_with(self, stack: Stack, tokens: Tensor, positions: Tensor) -> Tensor:
        """tokens [B, L] -> scaled embeddings + ``positions`` (broadcast to [B, L, D]), as ``stack`` reads them."""
        return self.dropout(stack.embedded(self.shared(tokens) * self.embed_scale + positions))

    def embed(self, tokens: Tensor, offset: int | Tensor = 0, stack: Stack | None = None) -> Tensor:
        """tokens [B, L] -> ``stack``'s (default: the encoder's) embeddings at positions ``offset ..
        offset+L-1``, [B, L, D]."""
        stack = self.encoder if stack is None else stack
        return self.embed_with(stack, tokens, self.position_rows(stack)[offset : offset + tokens.shape[1]])

    def encode(self, src: Tensor) -> EncoderOutput:
        src_mask = (src != self.config.pad_id)[:, None, None, :]
        x = self.embed(src)
        for layer in self.encoder.layers:
            x = layer(x, src_mask)
        return {"memory": self.encoder.finished(x), "src_mask": src_mask}

    def init_state(self, enc: EncoderOutput) -> DecoderState:
        memory = enc["memory"]
        batch = memory.shape[0]
        state: DecoderState = {"src_mask": enc["src_mask"]}
        for i, layer in enumerate(self.decoder.layers):
            cross = layer.encoder_attn
            state[f"cross_key.{i}"] = cross.split(cross.k_proj(memory))
            state[f"cross_value.{i}"] = cross.split(cross.v_proj(memory))
            empty = memory.new_zeros(batch, cross.heads, 0, cross.head_dim)
            state[f"self_key.{i}"] = empty
            state[f"self_value.{i}"] = empty
        return state

    def _decode(
        self, x: Tensor, state: DecoderState, causal_mask: Tensor | None, need_attention: bool
    ) -> tuple[Tensor, Tensor | None, DecoderState]:
        alignment_layer = self.config.alignment_layer % len(self.decoder.layers)
        new_state: DecoderState = dict(state)
        weights = None
        for i, layer in enumerate(self.decoder.layers):
            x, key, value, layer_weights = layer(
                x,
                state[f"self_key.{i}"],
                state[f"self_value.{i}"],
                state[f"cross_key.{i}"],
                state[f"cross_value.{i}"],
                state["src_mask"],
                causal_mask,
                need_attention and i == alignment_layer,
            )
            new_state[f"self_key.{i}"], new_state[f"self_value.{i}"] = key, value
            if layer_weights is not None:
                weights = layer_weights
        return self.lm_head(self.decoder.finished(x)) + self.final_logits_bias, weights, new_state

    def decode_step(
        self, tokens: Tensor, state: DecoderState, need_attention: bool = False
    ) -> tuple[Tensor, Tensor | None, DecoderState]:
        step = state["self_key.0"].shape[-2]
        x = self.embed(tokens[:, None], step, self.decoder)
        logits, weights, new_state = self._decode(x, state, None, need_attention)
        return logits[:, 0], (weights[:, 0] if weights is not None else None), new_state

    def forward(self, src: Tensor, tgt_in: Tensor) -> Tensor:
        return self.decode_full(src, tgt_in)[0]

    def decode_full(self, src: Tensor, tgt_in: Tensor, need_attention: bool = False) -> tuple[Tensor, Tensor | None]:
        """Teacher-forced logits [B, T, V] and (optionally) alignment-layer cross-attention [B, T, S]."""
        state = self.init_state(self.encode(src))
        length = tgt_in.shape[1]
        causal = torch.ones(length, length, dtype=torch.bool, device=src.device).tril()
        logits, weights, _ = self._decode(self.embed(tgt_in, 0, self.decoder), state, causal, need_attention)
        return logits, weights


def hf_state_dict(hf_state: dict[str, Tensor], *, learned_offset: int | None = None) -> dict[str, Tensor]:
    """Map a Hugging Face ``MarianMTModel``, ``M2M100ForConditionalGeneration`` or ``MBartForConditionalGeneration``
    state dict onto :class:`Transformer` parameter names: the shared embedding once (not each side's copy of it),
    position tables left out (computed here), or, with ``learned_offset`` (mBART's learned tables), kept without
    their first ``learned_offset`` rows, which no token reads (its positions start there)."""
    mapped = {}
    for name, value in hf_state.items():
        name = name.removeprefix("model.")
        if ".embed_tokens." in name:
            continue
        if ".embed_positions." in name:
            if learned_offset is None or not name.endswith(".weight"):
                continue
            value = value[learned_offset:]
        mapped[name] = value
    return mapped
