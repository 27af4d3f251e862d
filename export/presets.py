"""Named training recipes: the demo models and the benchmark runs use these, ``nmt train --preset`` too.

Each preset fixes the corpus, model dimensions and optimisation settings that were measured to
reach the quality targets on 2 CPU cores (see benchmarks/README.md for the figures).
"""

from __future__ import annotations

from typing import Any

PRESETS: dict[str, dict[str, Any]] = {
    # generated dates/numbers corpus: >= 98 BLEU in a few minutes
    "dates-transformer": {
        "arch": "transformer", "corpus": "dates", "vocab_size": 1000, "batch_tokens": 3000,
        "model": {"d_model": 128, "encoder_layers": 2, "decoder_layers": 2, "heads": 4, "ffn_dim": 512},
        "lr": 1.5e-3, "warmup_steps": 200, "valid_every": 200, "max_minutes": 4.5, "target_bleu": 99.5,
    },
    "dates-bahdanau": {
        "arch": "bahdanau", "corpus": "dates", "vocab_size": 1000, "batch_tokens": 3000,
        "model": {"embed_dim": 64, "encoder_hidden": 128, "decoder_hidden": 256, "attention_dim": 128},
        "lr": 2e-3, "valid_every": 200, "max_minutes": 4.5, "target_bleu": 99.5,
    },
    # Ding dictionary example sentences (~16k pairs)
    "ding-transformer": {
        "arch": "transformer", "corpus": "ding", "vocab_size": 6000, "batch_tokens": 4096,
        "model": {"d_model": 256, "encoder_layers": 3, "decoder_layers": 3, "heads": 4, "ffn_dim": 1024,
                  "dropout": 0.3},
        "lr": 7e-4, "warmup_steps": 800, "valid_every": 300, "max_minutes": 25.0, "patience": 6,
    },
    "ding-bahdanau": {
        "arch": "bahdanau", "corpus": "ding", "vocab_size": 6000, "batch_tokens": 4096,
        "model": {"embed_dim": 256, "encoder_hidden": 256, "decoder_hidden": 512, "attention_dim": 256,
                  "dropout": 0.3},
        "lr": 1e-3, "valid_every": 300, "max_minutes": 25.0, "patience": 6,
    },
}
