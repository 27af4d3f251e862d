"""An OPUS-MT-sized model through ``nmt export`` and ``nmt serve`` (``nmt bench export``).

Builds a random-weight Hugging Face Marian directory shaped like ``Helsinki-NLP/opus-mt-en-de`` (d_model
512, 6+6 layers, 8 heads, ffn 2048, swish, tied embeddings, ``final_logits_bias``, a shared vocabulary of
58,101 pieces, of which most are in neither SentencePiece model, as in the real one), made confident as a
trained model is (half the vocabulary's ``final_logits_bias`` pushed to -2,000..-4,000), then measures:

- ``nmt export`` in its own process: wall time, peak RSS of its processes summed (sampled; against the
  checkpoint's size; goal <= 3x) and of the largest alone;
- the bytes the version holds against the checkpoint's (goal <= 1.1x);
- ``nmt serve`` with the version loaded, after one translation, with and without ``--ort-prepack`` (the HTTP
  face off, as in the other server benchmarks; once more with it on, which loads aiohttp): its RSS, and its
  growth over the same server with ``--engine null`` (no weights), against the weights' fp32 bytes (goal <=
  1.5x);
- greedy and beam-4 token ids of the serving engine against ``MarianMTModel.generate`` on 20 sentences;
- what pre-packing buys: the engine with and without ``prepack`` (``--ort-prepack``), runs alternating,
  median time to translate one sentence and all 20, greedy and beam 4.

``--size SMALL`` runs a reduced model (vocabulary 8,000) for a quick look.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script: this checkout's packages

from benchmarks.engine_throughput import host  # noqa: E402
from benchmarks.server_load import start_server  # noqa: E402
from common.model_format.decoding import max_target_length  # noqa: E402

SIZES = {
    "OPUS": dict(d_model=512, layers=6, heads=8, ffn=2048, vocab=58101),
    "SMALL": dict(d_model=256, layers=3, heads=4, ffn=1024, vocab=8000),
}
SENTENCES = 20
MAX_LENGTH = 32
NAME = "opus-like"
HTTP_ON = "--no-ort-prepack --http-listen 127.0.0.1:0"  # the servers above run without the HTTP face (its aiohttp)


def build_marian(directory: Path, size: str) -> tuple[Path, list[str]]:
    """The random, confident Marian directory and 20 source sentences."""
    import torch
    from transformers import MarianConfig, MarianMTModel, MarianTokenizer

    from tests.marian import dates_split, write_tokenizer_files

    s = SIZES[size]
    known = len(write_tokenizer_files(directory))
    extra = tuple(f"w{i}" for i in range(s["vocab"] - known))  # shared-vocabulary pieces neither model has
    pieces = write_tokenizer_files(directory, extra)
    assert len(pieces) == s["vocab"], len(pieces)
    pad = len(pieces) - 1
    config = MarianConfig(
        vocab_size=len(pieces), d_model=s["d_model"], encoder_layers=s["layers"], decoder_layers=s["layers"],
        encoder_attention_heads=s["heads"], decoder_attention_heads=s["heads"], encoder_ffn_dim=s["ffn"],
        decoder_ffn_dim=s["ffn"], activation_function="swish", scale_embedding=True, pad_token_id=pad,
        eos_token_id=0, decoder_start_token_id=pad, max_position_embeddings=512, dropout=0.0,
        attention_dropout=0.0, activation_dropout=0.0,
    )
    torch.manual_seed(0)
    model = MarianMTModel(config).eval()
    with torch.no_grad():
        model.get_input_embeddings().weight[pad].zero_()
        generator = torch.Generator().manual_seed(1)
        far = torch.randperm(len(pieces), generator=generator)[: len(pieces) // 2]
        far = far[far != 0]  # EOS stays reachable
        model.final_logits_bias[0, far] = -2000.0 - 2000.0 * torch.rand(len(far), generator=generator)
    model.generation_config.bad_words_ids = [[pad]]
    model.generation_config.num_beams = 4
    model.generation_config.max_length = MAX_LENGTH
    model.save_pretrained(directory)
    MarianTokenizer(str(directory / "source.spm"), str(directory / "target.spm"), str(directory / "vocab.json"),
                    source_lang="en", target_lang="de").save_pretrained(directory)
    return directory, [source for source, _ in dates_split()[1]][:SENTENCES]


def peak_rss_run(command: list[str]) -> tuple[float, int, int]:
    """Run ``command``; (wall seconds, the peak RSS of its largest process, the peak of the RSS summed over it
    and its child processes) in bytes, from its process tree sampled every 20 ms (:func:`process_tree`): each
    process's own high-water mark (VmHWM, exact), and the sum of the processes' RSS at each sample. Not
    ``os.wait4``'s ``ru_maxrss``: a child forked from this process starts with this process's memory
    counted (the Marian model built here), and keeps that high-water mark across its exec."""
    start = time.perf_counter()
    process = subprocess.Popen(command)
    peak_sum, high_water, done = 0, 0, threading.Event()

    def sample() -> None:
        nonlocal peak_sum, high_water
        while not done.wait(0.02):
            tree = [memory for pid in process_tree(process.pid) if (memory := rss(pid))]
            peak_sum = max(peak_sum, sum(current for current, _ in tree))
            high_water = max([high_water, *(peak for _, peak in tree)])

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    process.wait()
    done.set()
    sampler.join()
    if process.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed with {process.returncode}")
    return time.perf_counter() - start, high_water, peak_sum


def process_tree(pid: int) -> set[int]:
    """Process ``pid`` and all its descendants now."""
    parents: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            parents[int(stat.parent.name)] = int(stat.read_text().rsplit(")", 1)[1].split()[1])
    tree, grown = {pid}, True
    while grown:
        children = {child for child, parent in parents.items() if parent in tree} - tree
        tree |= children
        grown = bool(children)
    return tree


def rss(pid: int) -> tuple[int, int] | None:
    """The process's resident set now and its high-water mark, in bytes (None once it is gone)."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as status:
            fields = dict(line.split(":", 1) for line in status)
    except OSError:
        return None
    return int(fields["VmRSS"].split()[0]) * 1024, int(fields["VmHWM"].split()[0]) * 1024


def server_rss(repository: Path, text: str, flags: list[str]) -> int:
    """RSS of ``nmt serve FLAGS`` over ``repository`` after translating ``text``."""
    import grpc

    from server.protos import pb2, pb2_grpc

    process, address, _ = start_server(str(repository), ["--max-batch-rows", "32", *flags])
    try:
        with grpc.insecure_channel(address) as channel:
            pb2_grpc.TranslatorStub(channel).Translate(
                pb2.TranslateRequest(model=NAME, texts=[text], options=pb2.DecodingOptions(beam_size=4)), timeout=120)
        return rss(process.pid)[0]
    finally:
        process.terminate()
        process.wait(30)


def generate_ids(directory: Path, texts: list[str], beam: int) -> list[list[int]]:
    """``MarianMTModel.generate`` token ids without decoder start, EOS and padding, each sentence under the
    serving search's length cap (:func:`max_target_length` of its source, EOS included)."""
    import torch
    from transformers import MarianMTModel, MarianTokenizer

    model = MarianMTModel.from_pretrained(directory).eval()
    tokenizer = MarianTokenizer.from_pretrained(directory)
    special = {model.config.pad_token_id, model.config.eos_token_id, model.config.decoder_start_token_id}
    ids = []
    for text in texts:
        batch = tokenizer([text], return_tensors="pt")
        cap = max_target_length(batch["input_ids"].shape[1], MAX_LENGTH)
        with torch.no_grad():
            output = model.generate(**batch, num_beams=beam, do_sample=False, max_length=cap + 1)
        ids.append([int(i) for i in output[0] if int(i) not in special])
    return ids


def engine_ids(version: Path, texts: list[str], beam: int) -> list[list[int]]:
    """The serving engine's token ids for ``texts`` at ``beam`` (max length as generate's)."""
    from server.engine.engine import Engine

    engine = Engine.load(version, provider="cpu", intra_op_threads=2, inter_op_threads=1)
    options = dataclasses.replace(engine.default_options(), beam_size=beam, max_length=MAX_LENGTH)
    return [list(translation.hypotheses[0].token_ids) for translation in engine.translate(texts, options)]


def prepack_speed(version: Path, texts: list[str], repeats: int) -> list[str]:
    """Table rows: median seconds of the engine with and without pre-packing, runs alternating."""
    import statistics

    from server.engine.engine import Engine

    engines = {packed: Engine.load(version, provider="cpu", intra_op_threads=2, inter_op_threads=1, prepack=packed)
               for packed in (True, False)}
    rows = []
    for beam, count in ((1, 1), (1, len(texts)), (4, 1), (4, len(texts))):
        times: dict[bool, list[float]] = {True: [], False: []}
        for _ in range(repeats):
            for packed, engine in engines.items():
                options = dataclasses.replace(engine.default_options(), beam_size=beam, max_length=MAX_LENGTH)
                start = time.perf_counter()
                engine.translate(texts[:count], options)
                times[packed].append(time.perf_counter() - start)
        packed, plain = statistics.median(times[True]), statistics.median(times[False])
        rows.append(f"| beam {beam}, {count} sentence{'s' if count > 1 else ''} | {packed * 1000:,.0f} ms | "
                    f"{plain * 1000:,.0f} ms | {plain / packed:.2f}x |")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="OPUS")
    parser.add_argument("--work", help="keep the Marian directory and the repository here (default: a temp dir)")
    parser.add_argument("--repeats", type=int, default=5, help="runs of each engine in the pre-packing comparison")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-export-") as scratch:
        work = Path(args.work or scratch)
        marian, texts = build_marian(work / "marian", args.size)
        checkpoint = (marian / "model.safetensors").stat().st_size
        repository = work / "models"
        seconds, peak, peak_sum = peak_rss_run([sys.executable, "-m", "nmt", "export", str(marian), "--name", NAME,
                                      "--model-repository", str(repository), "--no-progress", "--force",
                                      "--version", "1"])
        version = repository / NAME / "1"
        written = sum(path.stat().st_size for path in version.iterdir() if path.is_file())
        idle = {http: server_rss(repository, texts[0], ["--engine", "null", *(HTTP_ON.split()[1:] if http else [])])
                for http in (False, True)}  # the server without weights, HTTP face off and on
        loaded = {flags: server_rss(repository, texts[0], flags.split())
                  for flags in ("--ort-prepack", "--no-ort-prepack", HTTP_ON)}
        matches = {beam: sum(a == b for a, b in zip(engine_ids(version, texts, beam), generate_ids(marian, texts, beam),
                                                    strict=True))
                   for beam in (1, 4)}
        speed = prepack_speed(version, texts, args.repeats)
        manifest = json.loads((version / "manifest.json").read_text())
        mib = 2**20
        print(f"\n{host()}; model {args.size} {SIZES[args.size]}, checkpoint {checkpoint / mib:.0f} MiB")
        print("| measure | value | against the checkpoint | goal |\n|---|---|---|---|")
        print(f"| export wall time | {seconds:.0f} s | | |")
        print(f"| export peak RSS, its processes summed (sampled every 20 ms) | {peak_sum / mib:,.0f} MiB | "
              f"{peak_sum / checkpoint:.2f}x | <= 3x |")
        print(f"| export peak RSS, its largest process (VmHWM) | {peak / mib:,.0f} MiB | {peak / checkpoint:.2f}x | |")
        print(f"| version bytes | {written / mib:,.0f} MiB | {written / checkpoint:.2f}x | <= 1.1x |")
        for flags, size in loaded.items():
            empty = idle[flags == HTTP_ON]
            print(f"| server RSS, one version loaded, {flags} | {size / mib:,.0f} MiB (--engine null: "
                  f"{empty / mib:,.0f}) | {size / checkpoint:.2f}x (growth {(size - empty) / checkpoint:.2f}x) "
                  "| <= 1.5x |")
        print(f"| greedy / beam 4 equal to generate | {matches[1]}/{len(texts)}, {matches[4]}/{len(texts)} | | all |")
        print(f"parity recorded by the export: {manifest['parity']}")
        print("\n| translating (CPU, 2 threads) | --ort-prepack | --no-ort-prepack | ratio |\n|---|---|---|---|")
        print("\n".join(speed))


if __name__ == "__main__":
    main()
