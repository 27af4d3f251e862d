"""What the decoders' ``logits`` output and the decoding controls cost (``nmt bench controls``).

One model version, loaded twice: as exported (its decoder graphs output ``logits``) and with that output
removed (as a version exported before it), translating the same batch of sentences with no controls, then
the first with ``min_length`` (the controls' full-distribution path, no logits) and with
``repetition_penalty`` (which also fetches the logits). Runs alternate; medians per batch and the ratio
to the version without the output. Default model: the small Marian model of the tests (trained here,
about 30 s), on its 20 held-out sentences.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import onnx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script: this checkout's packages

from benchmarks.engine_throughput import host  # noqa: E402
from common.model_format.manifest import LOGITS_OUTPUT, sha256_file  # noqa: E402
from export.graph_passes import remove_output  # noqa: E402
from server.controls import Controls  # noqa: E402
from server.engine.engine import Engine  # noqa: E402


def without_logits(version_dir: Path, target: Path) -> Path:
    """A copy of ``version_dir`` whose decoder graphs lack the ``logits`` output (manifest digests updated)."""
    shutil.copytree(version_dir, target)
    manifest = json.loads((target / "manifest.json").read_text())
    for role in ("decoder", "decoder_attention"):
        path = target / manifest["graphs"][role]
        onnx.save(remove_output(onnx.load(str(path)), LOGITS_OUTPUT), str(path))
        manifest["files"][path.name] = sha256_file(path)
    (target / "manifest.json").write_text(json.dumps(manifest, indent=2))
    return target


def marian_version(work: Path) -> tuple[Path, list[str]]:
    """The tests' small Marian model imported with ``nmt export``, and its held-out sentences."""
    from nmt.cli import main as nmt_main
    from tests.marian import MODEL, build_marian_dir, held_out

    directory = build_marian_dir(work / "marian")
    assert nmt_main(["export", str(directory), "--name", MODEL, "--model-repository", str(work / "models"),
                     "--no-progress"]) == 0
    return work / "models" / MODEL / "1", held_out()


def batch(engine: Engine, texts: list[str], beam: int, **controls: float) -> Callable[[], object]:
    """Translating ``texts`` in one batch at ``beam`` under ``controls``."""
    options = dataclasses.replace(engine.default_options(), beam_size=beam, controls=Controls(**controls))
    return lambda: engine.translate(texts, options)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version-dir", type=Path, help="a model version exported with its logits output "
                        "(default: the tests' small Marian model)")
    parser.add_argument("--texts", type=Path, help="sentences to translate, one per line (with --version-dir)")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--threads", type=int, default=1, help="ONNX Runtime intra-op threads")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        if args.version_dir:
            if not args.texts:
                parser.error("--version-dir needs --texts")
            version, texts = args.version_dir, args.texts.read_text(encoding="utf-8").splitlines()
        else:
            version, texts = marian_version(work)
        with_output, without_output = (Engine.load(directory, provider="cpu", intra_op_threads=args.threads,
                                                   inter_op_threads=1)
                                       for directory in (version, without_logits(version, work / "without-logits")))
        if not with_output.has_logits:
            raise SystemExit(f"{version} has no {LOGITS_OUTPUT} output: export it with this version of nmt export")
        print(f"{host()}; ONNX Runtime, {args.threads} thread(s); {len(texts)} sentences per batch; "
              f"median of {args.repeats} alternating runs")
        for beam in (1, 4):
            cases = {"no controls, graphs without logits": batch(without_output, texts, beam),
                     "no controls, graphs with logits": batch(with_output, texts, beam),
                     "min_length 2 (full distribution)": batch(with_output, texts, beam, min_length=2),
                     "repetition_penalty 1.5 (+ logits)": batch(with_output, texts, beam, repetition_penalty=1.5)}
            times: dict[str, list[float]] = {name: [] for name in cases}
            for case in cases.values():
                case()  # warm up
            for _ in range(args.repeats):
                for name, case in cases.items():
                    start = time.perf_counter()
                    case()
                    times[name].append(time.perf_counter() - start)
            base = statistics.median(times["no controls, graphs without logits"])
            print(f"\nbeam {beam}\n| case | ms per batch | vs without logits |\n|---|---|---|")
            for name, values in times.items():
                median = statistics.median(values)
                print(f"| {name} | {median * 1000:.1f} | {median / base:.2f}x |")


if __name__ == "__main__":
    main()
