"""Transformer and Bahdanau models: incremental decoding, padding, overfitting, checkpoints."""

import pytest
import torch
import torch.nn.functional as F

from common.errors import NmtError
from training.models.checkpoint import build_model, load_checkpoint, save_checkpoint
from training.search import greedy_batch, translate_ids
from training.train import collate

TINY = {
    "transformer": dict(d_model=32, heads=4, ffn_dim=64, encoder_layers=2, decoder_layers=2),
    "bahdanau": dict(embed_dim=16, encoder_hidden=16, decoder_hidden=32, attention_dim=16),
    "bahdanau-general": dict(embed_dim=16, encoder_hidden=16, decoder_hidden=32, score="general"),
    "bahdanau-dot": dict(embed_dim=16, encoder_hidden=16, decoder_hidden=32, score="dot"),
}
SRC = torch.tensor([[5, 6, 7, 8, 3], [9, 10, 3, 0, 0]])
TGT = torch.tensor([[2, 11, 12, 13, 14], [2, 14, 15, 16, 0]])


def tiny(name: str, vocab: int = 40, **extra):
    torch.manual_seed(0)
    return build_model(name.split("-")[0], vocab_size=vocab, dropout=0.0, **TINY[name], **extra).eval()


@pytest.mark.parametrize("name", list(TINY))
def test_incremental_decoding_equals_teacher_forcing(name):
    model = tiny(name)
    with torch.no_grad():
        full_logits, full_attention = model.decode_full(SRC, TGT, need_attention=True)
        state = model.init_state(model.encode(SRC))
        logits, attention = [], []
        for t in range(TGT.shape[1]):
            step_logits, step_attention, state = model.decode_step(TGT[:, t], state, need_attention=True)
            logits.append(step_logits)
            attention.append(step_attention)
    torch.testing.assert_close(torch.stack(logits, 1), full_logits, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(torch.stack(attention, 1), full_attention, atol=1e-6, rtol=1e-5)
    assert torch.allclose(full_attention.sum(-1), torch.ones(2, TGT.shape[1]))
    assert (full_attention[1, :, 3:] == 0).all(), "padding gets no attention"


@pytest.mark.parametrize("name", ["transformer", "bahdanau"])
def test_padding_does_not_change_a_sentence(name):
    model = tiny(name)
    with torch.no_grad():
        batched = model(SRC, TGT)[1]
        alone = model(SRC[1:, :3], TGT[1:])[0]
    torch.testing.assert_close(batched, alone, atol=1e-5, rtol=1e-5)


def test_reorder_state_selects_rows():
    model = tiny("transformer")
    state = model.init_state(model.encode(SRC))
    _, _, state = model.decode_step(TGT[:, 0], state)
    reordered = model.reorder_state(state, torch.tensor([1, 1, 0]))
    for name, value in reordered.items():
        assert value.shape[0] == 3
        torch.testing.assert_close(value[2], state[name][0])


PAIRS = [([5, 6, 7, 3], [10, 11, 12]), ([6, 5, 3], [12, 10]), ([7, 7, 8, 9, 3], [13, 14, 15, 16, 17]),
         ([9, 3], [18]), ([8, 6, 5, 7, 3], [11, 19, 10, 13])]


@pytest.mark.parametrize("name", ["transformer", "bahdanau"])
def test_tiny_model_overfits_to_exact_output(name):
    model = tiny(name, vocab=24)
    optimizer = torch.optim.Adam(model.parameters(), lr=5e-3)
    src, tgt_in, tgt_out = collate(PAIRS)
    model.train()
    for _ in range(400):
        loss = F.cross_entropy(model(src, tgt_in).reshape(-1, 24), tgt_out.reshape(-1), ignore_index=0)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert greedy_batch(model, src, max_length=10) == [t for _, t in PAIRS]
    for source, target in PAIRS:
        assert translate_ids(model, source, beam_size=4)[0].tokens == target + [3]


@pytest.mark.parametrize("name", ["transformer", "bahdanau"])
def test_beam_one_equals_greedy_on_a_model(name):
    model = tiny(name)
    for source in SRC.tolist():
        source = [t for t in source if t]
        greedy = greedy_batch(model, torch.tensor([source]), max_length=12)[0]
        beam = translate_ids(model, source, beam_size=1, max_length=12)[0].tokens
        assert beam == greedy + [3]


def test_checkpoint_round_trip(tmp_path):
    model = tiny("bahdanau")
    save_checkpoint(tmp_path / "m.pt", model, step=3)
    loaded, payload = load_checkpoint(tmp_path / "m.pt")
    assert payload["step"] == 3 and loaded.config == model.config
    for key, value in model.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[key], value)


def test_bad_checkpoints_and_configs_are_clear_errors(tmp_path):
    with pytest.raises(NmtError, match="not found"):
        load_checkpoint(tmp_path / "missing.pt")
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(NmtError, match="cannot read"):
        load_checkpoint(tmp_path / "junk.pt")
    with pytest.raises(NmtError, match="unknown architecture"):
        build_model("lstm", vocab_size=10)
    with pytest.raises(NmtError, match="unknown transformer config"):
        build_model("transformer", vocab_size=10, width=3)


def test_marian_weights_load_and_give_the_same_logits():
    transformers = pytest.importorskip("transformers")
    from training.models.transformer import hf_state_dict

    config = transformers.MarianConfig(
        vocab_size=40, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, activation_function="swish",
        scale_embedding=True, pad_token_id=0, eos_token_id=3, decoder_start_token_id=0,
        max_position_embeddings=64, dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
    )
    torch.manual_seed(0)
    reference = transformers.MarianMTModel(config).eval()
    with torch.no_grad():
        reference.final_logits_bias.normal_()
    ours = build_model("transformer", vocab_size=40, d_model=32, encoder_layers=2, decoder_layers=2, heads=4,
                       ffn_dim=64, activation="swish", dropout=0.0, max_positions=64, decoder_start_id=0).eval()
    ours.load_state_dict(hf_state_dict(reference.state_dict()))
    tgt = TGT.clone()
    tgt[:, 0] = 0
    with torch.no_grad():
        expected = reference(input_ids=SRC, attention_mask=(SRC != 0).long(), decoder_input_ids=tgt).logits
        torch.testing.assert_close(ours(SRC, tgt)[0], expected[0], atol=1e-5, rtol=1e-5)
