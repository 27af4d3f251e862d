"""RNN encoder-decoder with attention (Bahdanau et al. 2015; Luong et al. 2015 score options).

Encoder: bidirectional GRU. The backward direction runs a forward GRU over each sentence reversed
*within its own length*, so padding never leaks into real positions and the graph exports to plain
ONNX ``GRU`` nodes. Decoder: GRU initialised from the backward encoder state, with input feeding
(the previous attention context is concatenated to the embedding). Attention scores:

* ``additive`` (Bahdanau): ``v · tanh(W s + U h)``, with ``U h`` computed once per sentence;
* ``general`` (Luong): ``s · (W h)``, ``W h`` computed once;
* ``dot`` (Luong): ``s · h`` (needs ``decoder_hidden == 2 * encoder_hidden``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from common.model_format.tokenizer import BOS_ID, EOS_ID, PAD_ID
from training.models.interface import DecoderState, EncoderOutput, Seq2SeqModel

SCORES = ("additive", "general", "dot")


@dataclass
class BahdanauConfig:
    vocab_size: int
    embed_dim: int = 256
    encoder_hidden: int = 256  # per direction
    decoder_hidden: int = 512
    attention_dim: int = 256
    score: str = "additive"
    dropout: float = 0.1
    tie_embeddings: bool = True
    pad_id: int = PAD_ID
    bos_id: int = BOS_ID
    eos_id: int = EOS_ID
    decoder_start_id: int = BOS_ID

    def __post_init__(self) -> None:
        if self.score not in SCORES:
            raise ValueError(f"unknown attention score {self.score!r}; choose one of {', '.join(SCORES)}")
        if self.score == "dot" and self.decoder_hidden != 2 * self.encoder_hidden:
            raise ValueError("dot attention needs decoder_hidden == 2 * encoder_hidden")


def reverse_within_length(x: Tensor, lengths: Tensor) -> Tensor:
    """Reverse each row of ``x`` [B, S, ...] over its first ``lengths[b]`` positions; padding stays put."""
    # the positions counted from the tensor, not torch.arange(x.shape[1]): a second ONNX export in one process
    # traced that size as a constant (torch 2.13), and the exported encoder then refused other source lengths
    positions = torch.ones_like(x[:, :, 0], dtype=torch.long).cumsum(1) - 1
    index = torch.where(positions < lengths[:, None], lengths[:, None] - 1 - positions, positions)
    return x.gather(1, index[:, :, None].expand(-1, -1, x.shape[2]))


class Bahdanau(Seq2SeqModel):
    """Decoder state: ``hidden`` [B, Hd], ``context`` [B, 2He] (input feeding), ``memory`` [B, S, 2He],
    ``keys`` [B, S, A or Hd or 2He] (precomputed source side of the score) and ``src_mask`` [B, S]."""

    arch = "bahdanau"

    def __init__(self, config: BahdanauConfig) -> None:
        super().__init__()
        self.config = cfg = config
        self.src_embed = nn.Embedding(cfg.vocab_size, cfg.embed_dim, padding_idx=cfg.pad_id)
        self.tgt_embed = nn.Embedding(cfg.vocab_size, cfg.embed_dim, padding_idx=cfg.pad_id)
        self.encoder_forward = nn.GRU(cfg.embed_dim, cfg.encoder_hidden, batch_first=True)
        self.encoder_backward = nn.GRU(cfg.embed_dim, cfg.encoder_hidden, batch_first=True)
        memory_dim = 2 * cfg.encoder_hidden
        self.init_hidden = nn.Linear(cfg.encoder_hidden, cfg.decoder_hidden)
        if cfg.score == "additive":
            self.key_proj = nn.Linear(memory_dim, cfg.attention_dim, bias=False)  # U
            self.query_proj = nn.Linear(cfg.decoder_hidden, cfg.attention_dim)  # W
            self.energy = nn.Linear(cfg.attention_dim, 1, bias=False)  # v
        elif cfg.score == "general":
            self.key_proj = nn.Linear(memory_dim, cfg.decoder_hidden, bias=False)
        self.decoder_rnn = nn.GRU(cfg.embed_dim + memory_dim, cfg.decoder_hidden, batch_first=True)
        self.output_proj = nn.Linear(cfg.decoder_hidden + memory_dim + cfg.embed_dim, cfg.embed_dim)
        self.generator = nn.Linear(cfg.embed_dim, cfg.vocab_size)
        if cfg.tie_embeddings:
            self.generator.weight = self.tgt_embed.weight
        self.dropout = nn.Dropout(cfg.dropout)

    def encode(self, src: Tensor) -> EncoderOutput:
        src_mask = src != self.config.pad_id
        lengths = src_mask.sum(1).clamp(min=1)
        x = self.dropout(self.src_embed(src))
        forward_out, _ = self.encoder_forward(x)
        backward_out, _ = self.encoder_backward(reverse_within_length(x, lengths))
        backward_out = reverse_within_length(backward_out, lengths)
        memory = torch.cat([forward_out, backward_out], dim=-1) * src_mask[:, :, None]
        keys = memory if self.config.score == "dot" else self.key_proj(memory)
        return {"memory": memory, "keys": keys, "src_mask": src_mask, "backward_final": backward_out[:, 0]}

    def init_state(self, enc: EncoderOutput) -> DecoderState:
        memory = enc["memory"]
        return {
            "hidden": torch.tanh(self.init_hidden(enc["backward_final"])),
            "context": memory.new_zeros(memory.shape[0], memory.shape[2]),
            "memory": memory,
            "keys": enc["keys"],
            "src_mask": enc["src_mask"],
        }

    def attend(self, hidden: Tensor, keys: Tensor, memory: Tensor, src_mask: Tensor) -> tuple[Tensor, Tensor]:
        """``hidden`` [B, Hd] -> (context [B, 2He], weights [B, S])."""
        if self.config.score == "additive":
            scores = self.energy(torch.tanh(self.query_proj(hidden)[:, None, :] + keys))[:, :, 0]
        else:
            scores = (keys @ hidden[:, :, None])[:, :, 0]
        weights = scores.masked_fill(~src_mask, float("-inf")).softmax(-1)
        return (weights[:, None, :] @ memory)[:, 0], weights

    def decode_step(
        self, tokens: Tensor, state: DecoderState, need_attention: bool = False
    ) -> tuple[Tensor, Tensor | None, DecoderState]:
        embedded = self.dropout(self.tgt_embed(tokens))
        rnn_in = torch.cat([embedded, state["context"]], dim=-1)[:, None, :]
        _, hidden = self.decoder_rnn(rnn_in, state["hidden"][None])
        hidden = hidden[0]
        context, weights = self.attend(hidden, state["keys"], state["memory"], state["src_mask"])
        output = torch.tanh(self.output_proj(torch.cat([hidden, context, embedded], dim=-1)))
        logits = self.generator(self.dropout(output))
        new_state = dict(state, hidden=hidden, context=context)
        return logits, (weights if need_attention else None), new_state

    def forward(self, src: Tensor, tgt_in: Tensor) -> Tensor:
        return self.decode_full(src, tgt_in)[0]

    def decode_full(self, src: Tensor, tgt_in: Tensor, need_attention: bool = False) -> tuple[Tensor, Tensor | None]:
        """Teacher forcing is sequential here (input feeding): logits [B, T, V], weights [B, T, S]."""
        state = self.init_state(self.encode(src))
        logits, weights = [], []
        for t in range(tgt_in.shape[1]):
            step_logits, step_weights, state = self.decode_step(tgt_in[:, t], state, need_attention)
            logits.append(step_logits)
            weights.append(step_weights)
        return torch.stack(logits, 1), (torch.stack(weights, 1) if need_attention else None)
