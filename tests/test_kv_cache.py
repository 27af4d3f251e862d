"""The Transformer's in-place KV cache (nmt-model/2): rows at their own positions, buffers that grow and
move only the rows that moved; versions exported before it (nmt-model/1, the concatenating cache) are refused."""

from __future__ import annotations

import gc
import json
import shutil
import tracemalloc
import weakref
from dataclasses import replace
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper

from common.model_format.layout import MANIFEST_FILE
from common.model_format.manifest import Manifest, ManifestError, read_manifest, sha256_file
from export.options import LOGIT_TOLERANCE
from server.engine import onnx_step_model
from server.engine.engine import Engine
from server.engine.onnx_step_model import INITIAL_CAPACITY
from training.models.checkpoint import load_checkpoint

TEXTS = ["one two", "three four five six", "seven", "eight nine ten one two", "two two three"]


@pytest.fixture(scope="module")
def engines(model_version_dir):
    return {state: Engine.load(model_version_dir, provider="cpu", intra_op_threads=1, device_state=state)
            for state in (False, True)}


def encode(engine: Engine, text: str) -> tuple[dict, dict]:
    src = np.array([engine.tokenize(text) + [engine.eos_id]], dtype=np.int64)
    encoded = engine.model.encode(src)
    return ({name: encoded[name] for name in engine.model.static_names},
            {name: encoded[name] for name in engine.model.state_names})


def advance(engine: Engine, static: dict, state: dict, tokens: list[int]) -> dict:
    """``state`` after teacher-forcing one row through ``tokens``."""
    for token in tokens:
        state = engine.model.step(np.array([token]), static, state, False, 1).state
    return state


@pytest.mark.parametrize("device_state", [False, True])
def test_rows_at_different_positions_decode_as_alone(engines, device_state):
    """Rows decoded separately, then joined with concat_rows (different source lengths and cache capacities,
    zero-padded), give each row the next-token distribution it has alone, within 1e-5."""
    engine = engines[device_state]
    model = engine.model
    assert model.capabilities.per_row_positions
    targets = {"one two three": [engine.start_id] + list(range(5, 5 + INITIAL_CAPACITY + 3)),  # grown once
               "seven": [engine.start_id, 7], "eight nine ten one two": [engine.start_id]}
    rows = []
    for text, tokens in targets.items():
        static, state = encode(engine, text)
        rows.append((static, advance(engine, static, state, tokens[:-1]), tokens[-1]))
    static, state = rows[0][0], rows[0][1]
    for other_static, other_state, _ in rows[1:]:
        static, state = model.concat_rows(static, other_static), model.concat_rows(state, other_state)
    positions = np.array([len(tokens) - 1 for tokens in targets.values()])
    np.testing.assert_array_equal(state[model.positions], positions)
    tokens = np.array([token for _, _, token in rows])
    joined = model.step(tokens, static, state, True, 3, full=True)
    explicit = model.step(tokens, static, state, True, 3, full=True, positions=positions)
    for i, (row_static, row_state, token) in enumerate(rows):
        alone = model.step(np.array([token]), row_static, row_state, True, 3, full=True)
        np.testing.assert_allclose(joined.log_probs[i], alone.log_probs[0], atol=1e-5, rtol=0)
        np.testing.assert_allclose(explicit.log_probs[i], alone.log_probs[0], atol=1e-5, rtol=0)
        width = alone.attention.shape[1]
        np.testing.assert_allclose(joined.attention[i, :width], alone.attention[0], atol=1e-5, rtol=0)
        assert (joined.attention[i, width:] == 0).all(), "a shorter source's padding gets no attention"
        np.testing.assert_array_equal(joined.top_ids[i], alone.top_ids[0])
    np.testing.assert_array_equal(joined.state[model.positions], positions + 1)


@pytest.mark.parametrize("device_state", [False, True])
def test_cache_grows_and_matches_pytorch(engines, tiny_runs, device_state):
    """A padded two-sentence batch teacher-forced for 40 steps (the buffers grow 16 -> 32 -> 64) keeps
    PyTorch's log-probabilities within the export tolerance at every step."""
    engine = engines[device_state]
    model, _ = load_checkpoint(tiny_runs["transformer"] / "best.pt")
    src = np.full((2, 6), engine.pad_id, dtype=np.int64)
    for i, text in enumerate(["one two three four five", "six"]):
        ids = engine.tokenize(text) + [engine.eos_id]
        src[i, : len(ids)] = ids
    encoded = engine.model.encode(src)
    static = {name: encoded[name] for name in engine.model.static_names}
    state = {name: encoded[name] for name in engine.model.state_names}
    tokens = np.array([engine.start_id, engine.start_id])
    with torch.no_grad():
        torch_state = model.init_state(model.encode(torch.from_numpy(src)))
        for step in range(40):
            logits, _, torch_state = model.decode_step(torch.from_numpy(tokens), torch_state)
            out = engine.model.step(tokens, static, state, False, 1, full=True)
            np.testing.assert_allclose(out.log_probs, logits.log_softmax(-1).numpy(), atol=LOGIT_TOLERANCE, rtol=0)
            state, tokens = out.state, np.array([5 + step % 7, 9 + step % 5])
    key = state["past_key_0"]
    assert (key.shape if isinstance(key, np.ndarray) else tuple(key.shape()))[2] == 64


def test_select_rows_moves_only_the_rows_that_moved(engines):
    engine = engines[False]
    model = engine.model
    static, state = encode(engine, "three four five")
    four = np.zeros(4, dtype=np.int64)  # one sentence, four rows
    static, state = model.select_rows(static, four), model.select_rows(state, four)
    state = advance_rows(engine, static, state, 3)
    buffer = state["past_key_0"]
    before = buffer.copy()

    kept = model.select_rows(state, np.array([0, 1, 3, 3]))  # one row of four moves: in place
    assert np.shares_memory(kept["past_key_0"], buffer)
    np.testing.assert_array_equal(kept["past_key_0"][[0, 1, 3]], before[[0, 1, 3]])  # untouched
    np.testing.assert_array_equal(kept["past_key_0"][2, :, :3], before[3, :, :3])
    np.testing.assert_array_equal(kept[model.positions], [3, 3, 3, 3])

    fewer = model.select_rows(kept, np.array([0, 1, 2]))  # rows leaving from the end: a view, nothing copied
    assert np.shares_memory(fewer["past_key_0"], buffer) and fewer["past_key_0"].shape[0] == 3

    reordered = model.select_rows(fewer, np.array([2, 1, 0]))  # most rows move: still in place, used positions only
    assert np.shares_memory(reordered["past_key_0"], buffer)
    np.testing.assert_array_equal(reordered["past_key_0"][:, :, :3], before[[3, 1, 0], :, :3])

    # more rows: written behind the others, in the spare rows the buffer was allocated with (twice four)
    more = model.select_rows(reordered, np.array([0, 0, 1, 2, 2]))
    assert np.shares_memory(more["past_key_0"], buffer) and more["past_key_0"].shape[0] == 5
    np.testing.assert_array_equal(more["past_key_0"][:, :, :3], before[[3, 3, 1, 0, 0], :, :3])

    most = model.select_rows(more, np.arange(9) % 5)  # more rows than there is room for: a new buffer
    assert not np.shares_memory(most["past_key_0"], buffer)
    np.testing.assert_array_equal(most["past_key_0"][:, :, :3], before[[3, 3, 1, 0, 0, 3, 3, 1, 0], :, :3])


def test_selections_from_a_fresh_state_do_not_share_memory(engines):
    """Two groups picked from one encoder output (forced.decode_batch, the continuous batcher's apart path) decode
    separately: nothing is in use yet, so each gets a buffer of its own."""
    engine = engines[False]
    model = engine.model
    _, state = encode(engine, "three four five")
    state = model.select_rows(state, np.zeros(3, dtype=np.int64))
    first, second = model.select_rows(state, np.array([0, 1])), model.select_rows(state, np.array([2]))
    assert not np.shares_memory(first["past_key_0"], second["past_key_0"])
    assert not np.shares_memory(first["past_key_0"], state["past_key_0"])


def advance_rows(engine: Engine, static: dict, state: dict, steps: int) -> dict:
    """Rows of ``state`` after ``steps`` steps of different tokens per row."""
    rows = len(state[engine.model.positions])
    for step in range(steps):
        tokens = np.arange(rows, dtype=np.int64) + 5 + step
        out = engine.model.step(tokens, static, state, False, 1)
        assert all(out.state[name] is state[name] for name in engine.model.buffers), "written in place"
        state = out.state
    return state


# ------------------------------------------------------------------------------ versions exported before


def concat_layout(version_dir: Path, target: Path) -> Path:
    """A copy of an nmt-model/2 Transformer version as versions exported before it were: self-attention
    ``MultiHeadAttention`` returning ``concat(past, new)``, the position read from ``past_key_0``'s length,
    no ``positions`` input, ``empty`` state entries and format nmt-model/1."""
    shutil.copytree(version_dir, target)
    manifest = read_manifest(target)
    for role in ("decoder", "decoder_attention"):
        path = target / manifest.graphs[role]
        model = onnx.load(str(path))
        graph = model.graph
        nodes: list[onnx.NodeProto] = []
        for node in graph.node:
            if node.op_type == "GroupQueryAttention":
                heads = next(a.i for a in node.attribute if a.name == "num_heads")
                qkv = list(node.input[:3])
                if not qkv[1]:  # packed QKV (query, key, value blocks): MultiHeadAttention takes them apart
                    qkv = [f"{node.output[0]}_{part}" for part in ("q", "k", "v")]
                    nodes.append(helper.make_node("Split", [node.input[0]], qkv, axis=-1, num_outputs=3))
                node = helper.make_node("MultiHeadAttention", [*qkv, "", "", "", *node.input[3:5]],
                                        list(node.output), domain="com.microsoft", num_heads=heads)
            nodes.append(node)
        del graph.node[:]
        graph.node.extend(nodes)
        graph.initializer.append(helper.make_tensor("legacy_length_axis", TensorProto.INT64, [], [2]))
        graph.node.insert(0, helper.make_node("Expand", ["legacy_length", "legacy_rows"], [manifest.decoder_positions]))
        graph.node.insert(0, helper.make_node("Shape", ["input_ids"], ["legacy_rows"]))
        graph.node.insert(0, helper.make_node("Gather", ["legacy_shape", "legacy_length_axis"], ["legacy_length"]))
        graph.node.insert(0, helper.make_node("Shape", ["past_key_0"], ["legacy_shape"]))
        inputs = [value for value in graph.input if value.name != manifest.decoder_positions]
        del graph.input[:]
        graph.input.extend(inputs)
        for node in [n for n in graph.node if n.output and n.output[0] in ("cache_seqlens", "cache_capacity",
                                                                            "cache_capacity_64", "cache_shape")]:
            graph.node.remove(node)
        onnx.save(model, str(path))
    data = json.loads((target / MANIFEST_FILE).read_text())
    data["format"] = "nmt-model/1"
    del data["decoder_positions"]
    for entry in data["decoder_state"]:
        entry["init"] = "empty"
        del entry["capacity_axis"]
    data["files"] = {name: sha256_file(target / name) for name in data["files"]}
    (target / MANIFEST_FILE).write_text(json.dumps(data))
    return target


@pytest.fixture(scope="module")
def concat_version(model_version_dir, tmp_path_factory) -> Path:
    return concat_layout(model_version_dir, tmp_path_factory.mktemp("legacy") / "1")


def test_versions_exported_before_are_refused_with_the_way_out(concat_version):
    """An nmt-model/1 version (concatenating cache) is refused at load, the message saying how to export it again."""
    with pytest.raises(ManifestError, match=r"'nmt-model/1' is no longer served .*export the model again from its "
                                            r"training run: nmt export RUN"):
        Engine.load(concat_version, provider="cpu", intra_op_threads=1)


def test_manifest_buffer_entries_are_validated(model_version_dir):
    manifest = read_manifest(model_version_dir)
    data = manifest.to_dict()
    with pytest.raises(ManifestError, match=r"'nmt-model/1' is no longer served"):
        Manifest.from_dict({**data, "format": "nmt-model/1"})
    with pytest.raises(ManifestError, match=r"unsupported format 'nmt-model/3' \(this server reads nmt-model/2\)"):
        Manifest.from_dict({**data, "format": "nmt-model/3"})
    with pytest.raises(ManifestError, match="decoder_positions"):
        Manifest.from_dict({**data, "decoder_positions": ""})
    broken = [dict(entry, capacity_axis=None) for entry in data["decoder_state"]]
    with pytest.raises(ManifestError, match="capacity_axis"):
        Manifest.from_dict({**data, "decoder_state": [{k: v for k, v in e.items() if v is not None} for e in broken]})


def test_joining_rows_go_into_the_room_behind_the_decode(engines):
    """concat_rows keeps spare rows: a later admission writes its rows there (zero-padded over whatever
    rows that left held), and a wider one gets a new array; the values are those of a plain concatenation."""
    def append(a: np.ndarray, b: np.ndarray) -> np.ndarray:
        return engines[False].model.concat_rows({"x": a}, {"x": b})["x"]

    decode = np.arange(2 * 3, dtype=np.float32).reshape(2, 3) + 1
    joined = append(decode, np.full((1, 3), 7, dtype=np.float32))  # no room yet: a new array
    assert joined.shape == (3, 3) and len(joined.base) == 6
    np.testing.assert_array_equal(joined, [[1, 2, 3], [4, 5, 6], [7, 7, 7]])

    joined[2:] = 9  # rows that leave stay behind in the room
    fewer = joined[:2]
    narrow = np.full((2, 2), 5, dtype=np.float32)  # a shorter source: zero-padded into the room
    again = append(fewer, narrow)
    assert np.shares_memory(again, joined) and again.shape == (4, 3)
    np.testing.assert_array_equal(again[2:], [[5, 5, 0], [5, 5, 0]])

    wide = append(again, np.ones((1, 4), dtype=np.float32))  # wider than the decode: a new array
    assert not np.shares_memory(wide, joined) and wide.shape == (5, 4)
    np.testing.assert_array_equal(wide[:, 3], [0, 0, 0, 0, 1])


def test_growing_the_cache_frees_each_old_buffer(engines, monkeypatch):
    """When a row reaches the buffers' capacity they grow one at a time in the state itself, each old
    buffer gone (no binding holds it) before the next grows: growing costs one buffer more, not a second
    cache."""
    engine = engines[False]
    static, state = encode(engine, "one two three")
    state = advance(engine, static, state, [engine.start_id] + [5] * (INITIAL_CAPACITY - 1))
    olds = [weakref.ref(b if b.base is None else b.base) for b in (state[n] for n in engine.model.buffers)]
    alive_at_each_growth = []
    grow = engine.model._grow

    def counting_grow(*args):
        gc.collect()
        alive_at_each_growth.append(sum(old() is not None for old in olds))
        return grow(*args)

    monkeypatch.setattr(engine.model, "_grow", counting_grow)
    state = engine.model.step(np.array([5]), static, state, False, 1).state
    assert state["past_key_0"].shape[2] == 2 * INITIAL_CAPACITY
    buffers = len(olds)
    assert alive_at_each_growth == list(range(buffers, 0, -1))  # the one growing now, and those after it
    gc.collect()
    assert all(old() is None for old in olds)


def test_a_finished_decode_leaves_nothing_allocated(model_version_dir, monkeypatch):
    """Once a batch's decode ends, its cache, static inputs and step outputs are let go of (the bindings
    would otherwise hold them until the next batch, ~1.6 GiB at NLLB-600M's size and 80 rows); here with
    the bound at which they are let go set to nothing, so that the tiny model's decode counts."""
    monkeypatch.setattr(onnx_step_model, "RELEASE_BYTES", 0)
    engine = Engine.load(model_version_dir, provider="cpu", intra_op_threads=1)
    texts = ["one two three four five six seven", "eight nine"] * 8
    options = replace(engine.default_options(), beam_size=4)
    engine.translate(texts, options)  # lazily made tables (top-k feeds, tokenizer caches) exist from here on
    gc.collect()
    tracemalloc.start()
    try:
        engine.translate(texts, options)
        gc.collect()
        held, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak > 1 << 20  # the decode did allocate its arrays
    assert held < 64 << 10, f"{held} bytes still held after the decode"
