"""The ``manifest.json`` of a model version: what the serving engine needs to run it (no torch).

A model version directory ``<repository>/<name>/<version>/`` holds the ONNX graphs, the tokenizer
(``spm.model``) and ``manifest.json``, written last by ``nmt export``. The manifest describes the
graphs' I/O so the engine stays architecture-agnostic:

* the encoder graph takes ``src_ids`` int64 [batch, src_len] and returns every name listed in
  ``decoder_static`` plus the initial value of each ``decoder_state`` entry whose ``init`` is
  ``"encoder"`` (under the entry's ``input`` name);
* a decoder graph takes ``input_ids`` int64 [batch], the static inputs and the state inputs and returns
  ``log_probs`` float32 [batch, vocab], each state entry's ``output`` and (``decoder_attention`` only)
  ``attention`` float32 [batch, src_len]; it also takes ``top_k`` int64 [1] (default 1) and returns
  ``top_ids`` int64 / ``top_log_probs`` float32 [batch, top_k] (the best tokens of each row, best
  first) and ``eos_log_prob`` float32 [batch], so the search never fetches the whole distribution
  (the engine refuses a decoder without them);
* an optional ``decoder_forced`` graph (versions exported before it lack it; the engine then forces given
  tokens step by step) runs the decoder over given target positions in one call: ``input_ids`` int64
  [batch, tgt_len], ``target_ids`` int64 [batch, tgt_len] and the static inputs -> ``target_log_probs``
  [batch, tgt_len], ``last_log_probs`` [batch, vocab], ``attention`` [batch, tgt_len, src_len] and each
  state entry's ``output`` after those positions (see :mod:`export.transformer_graphs`);
* a decoder graph may also return ``logits`` float32 [batch, vocab], the input of the softmax (versions
  exported since the repetition penalty scales logits have it; the server refuses ``repetition_penalty``
  on a version without it);
* a state entry whose ``init`` is ``"buffer"`` is a preallocated cache kept in place: zeros of shape
  ``[batch, *shape]`` with ``shape[capacity_axis - 1]`` set to the capacity the engine chooses (and grows);
  the decoder writes each row's new entry at that row's position and returns the same buffer, which the
  engine binds as both input and output (nothing is copied). Such a version names ``decoder_positions``:
  the int64 [batch] decoder input holding each row's target position (= its cached length), so rows of
  one step may be at different positions; entries beyond a row's position are never read;
* ``static_src_axes`` gives the source-length axis of each static input (pad there with zeros to
  merge sentences of different lengths into one batch; a zero in ``src_mask`` marks padding);
* a static input's element type is the encoder output's (float16 for the cross-attention keys and values of
  an fp16 version, as its ``"buffer"`` state is; the engine takes the types from the graphs).

:func:`read_manifest` validates the fields and the sha256 of every listed file.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from common.errors import NmtError
from common.model_format.layout import MANIFEST_FILE, TOKENIZER_FILE
from common.model_format.tokenizer import TOKENIZERS

FORMAT = "nmt-model/2"  # /2 added "buffer" state entries and decoder_positions (the in-place KV cache)
READABLE_FORMATS = (FORMAT,)
# formats earlier exports of this project wrote, which the server no longer reads: what to do instead
RETIRED_FORMATS = {"nmt-model/1": "its KV cache grows by concatenation, so rows cannot decode at positions of their "
                                  "own"}
REEXPORT = "export the model again from its training run: nmt export RUN --name NAME"
GRAPH_ROLES = ("encoder", "decoder", "decoder_attention")
PRECISIONS = ("fp32", "fp16", "int8")
STATE_INITS = ("encoder", "buffer")
SPECIAL_IDS = ("pad", "unk", "bos", "eos", "decoder_start")
TOP_K_INPUT = "top_k"
TOP_K_OUTPUTS = ["top_ids", "top_log_probs", "eos_log_prob"]
LOGITS_OUTPUT = "logits"  # optional: versions exported before it lack it (no repetition_penalty there)


class ManifestError(NmtError):
    """A model version directory whose manifest is missing, malformed or does not match its files."""


@dataclass
class StateTensor:
    """One recurrent decoder input fed back from an output of the previous step."""

    input: str  # decoder input name, e.g. ``past_key_0`` or ``hidden``
    output: str  # decoder output name holding the next value, e.g. ``present_key_0``
    init: str  # "encoder": the encoder output named like ``input``;
    # "buffer": an in-place cache, zeros [batch, *shape] with a chosen capacity on ``capacity_axis``
    shape: list[int] | None = None  # per-row shape without batch (init "buffer")
    dtype: str | None = None  # NumPy dtype name (init "buffer")
    capacity_axis: int | None = None  # the buffer's position axis in [batch, *shape] (init "buffer" only)

    def to_dict(self) -> dict[str, Any]:
        return {key: value for key, value in dataclasses.asdict(self).items() if value is not None}


@dataclass
class Manifest:
    """Mirror of ``manifest.json`` (see the module docstring for the graph contract)."""

    name: str
    version: str
    architecture: str
    source_language: str
    target_language: str
    vocab_size: int
    dimensions: dict[str, Any]  # the model config the graphs were exported from
    special_ids: dict[str, int]  # pad, unk, bos, eos, decoder_start
    opset: int
    onnxruntime_version: str  # the version that verified parity at export time
    precision: str  # "fp32", "fp16" (GPUs) or "int8" (CPUs)
    graphs: dict[str, str]  # role (encoder, decoder, decoder_attention[, decoder_forced]) -> file name
    decoder_static: list[str]
    decoder_state: list[StateTensor]
    files: dict[str, str]  # file name -> sha256 hex digest (every file but the manifest)
    tokenizer: str = TOKENIZER_FILE  # the joint SentencePiece model (tokenizer_type "sentencepiece")
    tokenizer_type: str = "sentencepiece"  # or "marian" (source.spm, target.spm, vocab.json), "huggingface"
    target_languages: list[str] = field(default_factory=list)  # a multilingual model's target codes
    # a many-to-many model's (M2M-100, NLLB-200, mBART-50): the source codes it reads (source_language is the
    # default), each code's token id, and where the tokens go: the source's first token, and the target's as the
    # decoder's forced first token ("decoder"; "" for Marian's >>xx<< token before the source)
    source_languages: list[str] = field(default_factory=list)
    language_tokens: dict[str, int] = field(default_factory=dict)
    target_language_token: str = ""
    source_language_token: str = ""  # "end": after the source's EOS (NLLB's legacy placement), "": first
    origin: dict[str, Any] = field(default_factory=dict)  # where an imported model came from (format, path...)
    static_src_axes: dict[str, int] = field(default_factory=dict)  # static input -> its src_len axis
    decoder_positions: str = ""  # int64 [batch] input of each row's target position ("buffer" state), else ""
    fused_ops: dict[str, dict[str, int]] = field(default_factory=dict)  # graph role -> op type -> count
    attention_blocks: dict[str, int] = field(default_factory=dict)  # {"fused": n, "total": n}
    node_counts: dict[str, dict[str, int]] = field(default_factory=dict)  # graph role -> {"traced": n, "written": n}
    parity: dict[str, Any] = field(default_factory=dict)
    training: dict[str, Any] = field(default_factory=dict)  # corpus, valid_bleu, test_bleu, steps
    quantization: dict[str, Any] | None = None  # method, bleu_fp32, bleu_<precision>, delta, test_sentences
    defaults: dict[str, Any] = field(default_factory=dict)  # beam_size, length_penalty, max_length
    created: str = ""  # ISO 8601 UTC time of export
    format: str = FORMAT

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["decoder_state"] = [entry.to_dict() for entry in self.decoder_state]
        data = {"format": data.pop("format"), **data}
        return data

    def tokenizer_files(self) -> list[str]:
        """The tokenizer's files in the version directory."""
        if self.tokenizer_type == "sentencepiece":
            return [self.tokenizer]
        return list(TOKENIZERS[self.tokenizer_type].files) if self.tokenizer_type in TOKENIZERS else []

    @classmethod
    def from_dict(cls, data: dict[str, Any], *, where: str = MANIFEST_FILE) -> Manifest:
        """Build and validate a manifest from parsed JSON; raises :class:`ManifestError`."""
        if not isinstance(data, dict):
            raise ManifestError(f"{where}: expected a JSON object")
        if data.get("format") in RETIRED_FORMATS:
            raise ManifestError(f"{where}: format {data['format']!r} is no longer served "
                                f"({RETIRED_FORMATS[data['format']]}); {REEXPORT}")
        if data.get("format") not in READABLE_FORMATS:
            raise ManifestError(f"{where}: unsupported format {data.get('format')!r} (this server reads "
                                f"{', '.join(READABLE_FORMATS)})")
        known = {f.name for f in dataclasses.fields(cls)}
        required = [
            f.name
            for f in dataclasses.fields(cls)
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        ]
        missing = [name for name in required if name not in data]
        if missing:
            raise ManifestError(f"{where}: missing required fields: {', '.join(missing)}")
        values = {key: value for key, value in data.items() if key in known}  # newer fields are ignored
        try:
            values["decoder_state"] = [_state_from_dict(entry) for entry in data["decoder_state"]]
        except (TypeError, ValueError, KeyError) as error:
            raise ManifestError(f"{where}: bad decoder_state entry: {error}") from error
        values["version"] = str(values["version"])
        manifest = cls(**values)
        manifest.validate(where=where)
        return manifest

    def validate(self, *, where: str = MANIFEST_FILE) -> None:
        """Check types and cross-references between fields (not the files; see :func:`verify_files`)."""
        problems: list[str] = []
        for name in ("name", "version", "architecture", "source_language", "target_language", "tokenizer"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                problems.append(f"{name} must be a non-empty string")
        for name in ("vocab_size", "opset"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                problems.append(f"{name} must be a positive integer")
        if self.precision not in PRECISIONS:
            problems.append(f"precision must be one of {', '.join(PRECISIONS)}, not {self.precision!r}")
        if not isinstance(self.special_ids, dict) or any(
            not isinstance(self.special_ids.get(key), int) for key in SPECIAL_IDS
        ):
            problems.append(f"special_ids needs integer {', '.join(SPECIAL_IDS)}")
        if not isinstance(self.graphs, dict) or any(role not in self.graphs for role in GRAPH_ROLES):
            problems.append(f"graphs needs {', '.join(GRAPH_ROLES)}")
        if not isinstance(self.files, dict):
            problems.append("files must map file names to sha256 digests")
        else:
            listed = list(self.graphs.values()) if isinstance(self.graphs, dict) else []
            for filename in [*listed, *self.tokenizer_files()]:
                if filename not in self.files:
                    problems.append(f"files has no sha256 for {filename}")
            for filename in self.files:
                if Path(filename).name != filename or filename in ("", ".", ".."):
                    problems.append(f"file name {filename!r} must be a plain name inside the version directory")
        if self.tokenizer_type not in TOKENIZERS:
            problems.append(f"tokenizer_type must be one of {', '.join(TOKENIZERS)}, not {self.tokenizer_type!r}")
        if not isinstance(self.decoder_static, list) or not all(isinstance(n, str) for n in self.decoder_static):
            problems.append("decoder_static must be a list of input names")
        names = [entry.input for entry in self.decoder_state]
        if len(set(names)) != len(names) or set(names) & set(self.decoder_static or []):
            problems.append("decoder_state and decoder_static input names must be unique")
        buffers = [entry.input for entry in self.decoder_state if entry.init == "buffer"]
        if bool(buffers) != bool(self.decoder_positions):
            problems.append("decoder_positions names the positions input exactly when decoder_state has buffers")
        if self.decoder_positions and self.decoder_positions in [*names, *(self.decoder_static or [])]:
            problems.append("decoder_positions must differ from the state and static input names")
        if problems:
            raise ManifestError(f"{where}: " + "; ".join(problems))


def _state_from_dict(entry: dict[str, Any]) -> StateTensor:
    if not isinstance(entry, dict):
        raise TypeError(f"expected an object, got {entry!r}")
    state = StateTensor(
        input=str(entry["input"]),
        output=str(entry["output"]),
        init=str(entry["init"]),
        shape=list(entry["shape"]) if entry.get("shape") is not None else None,
        dtype=entry.get("dtype"),
        capacity_axis=entry.get("capacity_axis"),
    )
    if state.init not in STATE_INITS:
        raise ValueError(f"{state.input}: init must be one of {', '.join(STATE_INITS)}, not {state.init!r}")
    if state.init == "buffer" and (state.shape is None or state.dtype is None):
        raise ValueError(f"{state.input}: init {state.init!r} needs shape and dtype")
    if (state.init == "buffer") != (state.capacity_axis is not None):
        raise ValueError(f"{state.input}: capacity_axis goes with init 'buffer' (and only with it)")
    if state.capacity_axis is not None and not (
            isinstance(state.capacity_axis, int) and 1 <= state.capacity_axis <= len(state.shape or [])):
        raise ValueError(f"{state.input}: capacity_axis must be an axis of [batch, *shape] after batch")
    if state.shape is not None and not all(isinstance(d, int) and d >= 0 for d in state.shape):
        raise ValueError(f"{state.input}: shape must hold non-negative integers")
    return state


def sha256_file(path: str | Path, chunk: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def verify_files(manifest: Manifest, version_dir: str | Path) -> None:
    """Check that every listed file exists and matches its sha256; raises :class:`ManifestError`."""
    version_dir = Path(version_dir)
    for filename, expected in manifest.files.items():
        path = version_dir / filename
        if not path.is_file():
            raise ManifestError(f"{version_dir}: {filename} is listed in {MANIFEST_FILE} but missing")
        actual = sha256_file(path)
        if actual != expected:
            raise ManifestError(
                f"{version_dir}: {filename} does not match its sha256 in {MANIFEST_FILE} "
                f"(expected {expected[:12]}..., found {actual[:12]}...): the file was changed or truncated"
            )


def read_manifest(version_dir: str | Path, *, verify: bool = True) -> Manifest:
    """Load and validate ``<version_dir>/manifest.json`` (and, with ``verify``, the files' sha256)."""
    version_dir = Path(version_dir)
    path = version_dir / MANIFEST_FILE
    if not path.is_file():
        raise ManifestError(f"{version_dir} is not a model version: {MANIFEST_FILE} not found")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ManifestError(f"cannot read {path}: {error}") from error
    manifest = Manifest.from_dict(data, where=str(path))
    if verify:
        verify_files(manifest, version_dir)
    return manifest


def write_manifest(manifest: Manifest, version_dir: str | Path) -> Path:
    """Validate ``manifest`` and write it as ``<version_dir>/manifest.json`` (atomically)."""
    manifest.validate(where=str(Path(version_dir) / MANIFEST_FILE))
    path = Path(version_dir) / MANIFEST_FILE
    tmp = path.with_name(f".{MANIFEST_FILE}.tmp")
    tmp.write_text(json.dumps(manifest.to_dict(), indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, path)
    return path
