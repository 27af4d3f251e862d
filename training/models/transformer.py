"""Transformer encoder-decoder (Vaswani et al. 2017), post-layer-norm, sinusoidal positions.

Parameter names follow Hugging Face ``MarianMTModel`` (``shared``, ``encoder.layers.N.self_attn.q_proj``,
``decoder.layers.N.encoder_attn``, ``lm_head``, ``final_logits_bias``...) so a Marian state dict loads
with :func:`marian_state_dict` and the same weights can be compared against other runtimes.
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


def sinusoidal_positions(length: int, dim: int) -> Tensor:
    """Marian layout: sines of all frequencies in the first half of the vector, cosines in the second."""
    position = torch.arange(length, dtype=torch.float64)[:, None]
    inv_freq = torch.pow(10000.0, -torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    angles = position * inv_freq[None, :]
    table = torch.zeros(length, dim, dtype=torch.float64)
    table[:, : dim // 2] = torch.sin(angles[:, : dim // 2 + dim % 2][:, : dim // 2])
    table[:, dim // 2 :] = torch.cos(angles[:, : dim - dim // 2])
    return table.float()


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

    def forward(self, x: Tensor, mask: Tensor) -> Tensor:
        attn = self.self_attn
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
        key = torch.cat([past_key, attn.split(attn.k_proj(x))], dim=-2)
        value = torch.cat([past_value, attn.split(attn.v_proj(x))], dim=-2)
        h, _ = attn(x, key, value, causal_mask)
        x = self.self_attn_layer_norm(x + self.dropout(h))
        h, weights = self.encoder_attn(x, cross_key, cross_value, src_mask, need_weights)
        x = self.encoder_attn_layer_norm(x + self.dropout(h))
        h = self.fc2(self.dropout(self.act(self.fc1(x))))
        return self.final_layer_norm(x + self.dropout(h)), key, value, weights


class Stack(nn.Module):
    def __init__(self, layers: list[nn.Module]) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)


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
        self.encoder = Stack([EncoderLayer(cfg) for _ in range(cfg.encoder_layers)])
        self.decoder = Stack([DecoderLayer(cfg) for _ in range(cfg.decoder_layers)])
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.shared.weight
        self.register_buffer("final_logits_bias", torch.zeros(1, cfg.vocab_size))
        self.register_buffer("positions", sinusoidal_positions(cfg.max_positions, cfg.d_model), persistent=False)
        self.embed_scale = math.sqrt(cfg.d_model) if cfg.scale_embedding else 1.0
        self.dropout = nn.Dropout(cfg.dropout)

    def embed(self, tokens: Tensor, offset: int | Tensor = 0) -> Tensor:
        """tokens [B, L] -> scaled embeddings + positions ``offset .. offset+L-1``, [B, L, D]."""
        positions = self.positions[offset : offset + tokens.shape[1]]
        return self.dropout(self.shared(tokens) * self.embed_scale + positions)

    def encode(self, src: Tensor) -> EncoderOutput:
        src_mask = (src != self.config.pad_id)[:, None, None, :]
        x = self.embed(src)
        for layer in self.encoder.layers:
            x = layer(x, src_mask)
        return {"memory": x, "src_mask": src_mask}

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
        return self.lm_head(x) + self.final_logits_bias, weights, new_state

    def decode_step(
        self, tokens: Tensor, state: DecoderState, need_attention: bool = False
    ) -> tuple[Tensor, Tensor | None, DecoderState]:
        step = state["self_key.0"].shape[-2]
        x = self.embed(tokens[:, None], step)
        logits, weights, new_state = self._decode(x, state, None, need_attention)
        return logits[:, 0], (weights[:, 0] if weights is not None else None), new_state

    def forward(self, src: Tensor, tgt_in: Tensor) -> Tensor:
        return self.decode_full(src, tgt_in)[0]

    def decode_full(self, src: Tensor, tgt_in: Tensor, need_attention: bool = False) -> tuple[Tensor, Tensor | None]:
        """Teacher-forced logits [B, T, V] and (optionally) alignment-layer cross-attention [B, T, S]."""
        state = self.init_state(self.encode(src))
        length = tgt_in.shape[1]
        causal = torch.ones(length, length, dtype=torch.bool, device=src.device).tril()
        logits, weights, _ = self._decode(self.embed(tgt_in), state, causal, need_attention)
        return logits, weights


def marian_state_dict(hf_state: dict[str, Tensor]) -> dict[str, Tensor]:
    """Map a Hugging Face ``MarianMTModel`` state dict onto :class:`Transformer` parameter names."""
    mapped = {}
    for name, value in hf_state.items():
        name = name.removeprefix("model.")
        if ".embed_tokens." in name or ".embed_positions." in name:
            continue
        mapped[name] = value
    return mapped
