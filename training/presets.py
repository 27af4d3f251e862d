"""Named training recipes: the demo models and the benchmark runs use these, ``nmt train --preset`` too.

Each preset fixes the corpus, model dimensions and optimisation settings that were measured to
reach the quality targets on 2 CPU cores (see benchmarks/README.md for the figures).
"""

from __future__ import annotations

from typing import Any

PRESETS: dict[str, dict[str, Any]] = {
    # generated dates/numbers corpus: >= 98 BLEU in a few minutes. The budget is counted in steps, so a slower
    # or busy machine takes longer but trains the same model; max_minutes only stops a run that is hopelessly
    # slow (training then says so). A cosine decay to zero at the last step settles the model in fewer steps
    # than the inverse square root did (benchmarks/README.md: the same test BLEU with 24 % fewer tokens here,
    # 1.6x fewer for the Bahdanau model, measured side by side).
    "dates-transformer": {
        "arch": "transformer", "corpus": "dates", "vocab_size": 1000, "batch_tokens": 2500,
        "model": {"d_model": 128, "encoder_layers": 2, "decoder_layers": 2, "heads": 4, "ffn_dim": 512},
        "lr": 2e-3, "warmup_steps": 150, "lr_schedule": "cosine", "valid_every": 200, "max_steps": 1000,
        "max_minutes": 20.0, "target_bleu": 99.5, "sentence_stops": 0.25, "term_slots": 0.1,
    },
    # the smallest that gets full dates right ("Tuesday, April 25, 2045" -> "Dienstag, 25. April 2045", beam 4):
    # ~85 BLEU in ~15 s on one core; the browser test of the alignment explorer trains it once per session
    "dates-transformer-small": {
        "arch": "transformer", "corpus": "dates", "corpus_size": 3000, "vocab_size": 400, "batch_tokens": 2000,
        "model": {"d_model": 64, "encoder_layers": 1, "decoder_layers": 1, "heads": 4, "ffn_dim": 128, "dropout": 0.0},
        "lr": 3e-3, "warmup_steps": 100, "valid_every": 300, "valid_size": 100, "max_steps": 300,
    },
    # term slots: a third of the dates, where the Transformer needs a tenth; with a tenth this model still placed
    # an unseen glossary term over the weekday at beam 4 (docs/glossaries.md)
    "dates-bahdanau": {
        "arch": "bahdanau", "corpus": "dates", "vocab_size": 1000, "batch_tokens": 2000,
        "model": {"embed_dim": 64, "encoder_hidden": 128, "decoder_hidden": 256, "attention_dim": 128},
        "lr": 4e-3, "warmup_steps": 100, "lr_schedule": "cosine", "valid_every": 200, "max_steps": 1600,
        "max_minutes": 20.0, "target_bleu": 99.5, "sentence_stops": 0.25, "term_slots": 0.3,
    },
    # Ding dictionary example sentences (~16.7k training pairs); sized for ~20 minutes on 2 CPU cores
    "ding-transformer": {
        "arch": "transformer", "corpus": "ding", "vocab_size": 4000, "batch_tokens": 2048,
        "model": {"d_model": 256, "encoder_layers": 2, "decoder_layers": 2, "heads": 4, "ffn_dim": 512,
                  "dropout": 0.2},
        "lr": 1e-3, "warmup_steps": 400, "valid_every": 250, "max_minutes": 20.0, "patience": 8,
    },
    "ding-bahdanau": {
        "arch": "bahdanau", "corpus": "ding", "vocab_size": 4000, "batch_tokens": 2048,
        "model": {"embed_dim": 128, "encoder_hidden": 192, "decoder_hidden": 384, "attention_dim": 192,
                  "dropout": 0.2},
        "lr": 1e-3, "valid_every": 250, "max_minutes": 20.0, "patience": 8,
    },
}
