"""An OPUS-MT-sized or NLLB-600M-sized model through ``nmt export`` and ``nmt serve`` (``nmt bench export``).

Builds a random-weight Hugging Face directory: by default Marian shaped like ``Helsinki-NLP/opus-mt-en-de`` (d_model
512, 6+6 layers, 8 heads, ffn 2048, swish, tied embeddings, ``final_logits_bias``, a shared vocabulary of
58,101 pieces, of which most are in neither SentencePiece model, as in the real one), made confident as a
trained model is (half the vocabulary's ``final_logits_bias`` pushed to -2,000..-4,000); with ``--size NLLB600M``
an ``M2M100ForConditionalGeneration`` shaped like ``facebook/nllb-200-distilled-600M`` (d_model 1,024, 12+12 layers,
16 heads, ffn 4,096, relu, a vocabulary of 256,206; its tokenizer an ``NllbTokenizer`` over a SentencePiece model
trained here, so most ids are no piece of it) whose outputs are compared under its default pair. It measures:

- ``nmt export`` in its own process: wall time, peak RSS of its processes summed (sampled to the end; against the
  checkpoint's size; goal <= 3x) and of the largest alone, checked against GNU time's figure (within 5 %, or the
  run fails);
- the bytes the version holds against the checkpoint's (goal <= 1.1x);
- ``nmt serve`` memory (the HTTP face off, as in the other server benchmarks) with its defaults, with every
  session pre-packed and none, and without malloc's retained memory: RSS with no version loaded (``--engine
  null``), loaded, after a burst of all 20 sentences at beam 4, and the peak and end of a sustained mixed load
  (``--callers`` callers for ``--load-seconds``: beam 1 or 4, one sentence or four long ones), against the
  version's weights; and that load's sentences/s, the speed each setting trades;
- greedy and beam-4 token ids of the serving engine against ``MarianMTModel.generate`` on 20 sentences;
- what pre-packing buys: the engine with each ``--ort-prepack`` choice, runs alternating, median time to
  translate all 20 sentences, greedy and beam 4, with and without attention;
- what each decoding control costs: the engine's output tokens/s with ``min_length``, a repetition penalty and
  no-repeat n-grams against none, greedy and beam 4, runs alternating.

``--size SMALL`` (and ``NLLBSMALL``) runs a reduced model (vocabulary 8,000) for a quick look.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import random
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script: this checkout's packages

from benchmarks.bench_common import host, start_server  # noqa: E402
from common.model_format.decoding import max_target_length  # noqa: E402

SIZES = {
    "OPUS": dict(d_model=512, layers=6, heads=8, ffn=2048, vocab=58101),
    "SMALL": dict(d_model=256, layers=3, heads=4, ffn=1024, vocab=8000),
    "NLLB600M": dict(d_model=1024, layers=12, heads=16, ffn=4096, vocab=256206),
    "NLLBSMALL": dict(d_model=256, layers=3, heads=4, ffn=1024, vocab=8000),
}
SENTENCES = 20
MAX_LENGTH = 32
NAME = "opus-like"
GNU_TIME = "/usr/bin/time"  # Debian's ``time`` package: the check on the sampled peak of the export
MEMORY_FLAGS = ("", "--ort-prepack all", "--ort-prepack none", "--malloc-retain-mb 0")
CONTROLS = {  # a control's cost: each alone against none, on the same sentences
    "min_length 6": dict(min_length=6),
    "repetition_penalty 1.2": dict(repetition_penalty=1.2),
    "no_repeat_ngram_size 3": dict(no_repeat_ngram_size=3),
}


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


def build_nllb(directory: Path, size: str) -> tuple[Path, list[str]]:
    """The random NLLB-shaped directory (:data:`SIZES`) and 20 source sentences."""
    from tests.marian import dates_split
    from tests.multilingual_dirs import random_nllb

    model, _ = random_nllb(directory, **SIZES[size], max_positions=1024)
    model.generation_config.max_length = MAX_LENGTH
    model.save_pretrained(directory)
    return directory, [source for source, _ in dates_split()[1]][:SENTENCES]


def peak_rss_run(command: list[str]) -> tuple[float, int, int, int | None]:
    """Run ``command``; (wall seconds, the peak RSS of its largest process, the peak of the RSS summed over it
    and its child processes, GNU time's maximum resident set size or None where ``/usr/bin/time`` is missing), in
    bytes. The process tree is sampled every 20 ms (:func:`process_tree`) until the command ends: each process's
    own high-water mark (VmHWM, exact while it lives) and the sum of the processes' RSS at each sample; a process
    that has just exited is skipped, and a sampler that fails fails the run. Not this process's ``os.wait4``
    ``ru_maxrss``: a child forked from here starts with this process's memory counted (the Marian model built
    here) and keeps that mark across its exec; GNU time forks from a small process, so its figure is the largest
    process's, the check on the sampled one."""
    timed = Path(GNU_TIME).exists()
    start = time.perf_counter()
    with tempfile.TemporaryFile(mode="w+") as report:
        process = subprocess.Popen([GNU_TIME, "-v", "-o", f"/dev/fd/{report.fileno()}", *command] if timed
                                   else command, pass_fds=(report.fileno(),) if timed else ())
        peak_sum, high_water, done, failure = 0, 0, threading.Event(), []

        def sample() -> None:
            nonlocal peak_sum, high_water
            try:
                while not done.wait(0.02):
                    tree = [memory for pid in process_tree(process.pid) if (memory := rss(pid))]
                    peak_sum = max(peak_sum, sum(current for current, _ in tree))
                    high_water = max([high_water, *(peak for _, peak in tree)])
            except BaseException as error:  # noqa: BLE001 - re-raised by the run below
                failure.append(error)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        process.wait()
        done.set()
        sampler.join()
        if failure:
            raise RuntimeError("the memory sampler failed; its figures would be short") from failure[0]
        if process.returncode != 0:
            raise SystemExit(f"{' '.join(command)} failed with {process.returncode}")
        report.seek(0)
        found = re.search(r"Maximum resident set size \(kbytes\): (\d+)", report.read()) if timed else None
    return time.perf_counter() - start, high_water, peak_sum, int(found.group(1)) * 1024 if found else None


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
    """The process's resident set now and its high-water mark, in bytes (None once it is gone or has exited:
    a zombie's status has no memory lines)."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as status:
            fields = dict(line.split(":", 1) for line in status if ":" in line)
    except OSError:
        return None
    if "VmRSS" not in fields or "VmHWM" not in fields:
        return None
    return int(fields["VmRSS"].split()[0]) * 1024, int(fields["VmHWM"].split()[0]) * 1024


def tree_rss(pid: int) -> int:
    """The RSS of process ``pid`` and its descendants now, summed (a server's front-ends and engine core)."""
    return sum(memory[0] for child in process_tree(pid) if (memory := rss(child)))


@dataclasses.dataclass
class ServerMemory:
    """A server's RSS (its processes summed, bytes): with no version loaded (``--engine null``), loaded, after a
    burst (all sentences in one request, beam 4), the peak and the end of a sustained mixed load; and that load's
    sentences/s."""

    empty: int
    loaded: int
    burst: int
    peak: int
    end: int
    sentences_per_second: float


def server_memory(repository: Path, texts: list[str], flags: list[str], seconds: float, callers: int) -> ServerMemory:
    """``nmt serve FLAGS`` over ``repository`` (defaults otherwise, the HTTP face off) through a burst and then
    ``seconds`` of ``callers`` callers, each sending one request after another: beam 1 or 4, one sentence or four
    long ones (three of the texts joined by commas), drawn at random; RSS sampled every 0.25 s."""
    import grpc

    from server.protos import pb2, pb2_grpc

    empty_process, _, _ = start_server(str(repository), ["--engine", "null"])
    try:
        empty = tree_rss(empty_process.pid)
    finally:
        empty_process.terminate()
        empty_process.wait(30)
    process, address, _ = start_server(str(repository), flags)
    long = [", ".join(random.Random(i).sample(texts, 3)) for i in range(len(texts))]
    try:
        loaded = tree_rss(process.pid)
        with grpc.insecure_channel(address) as channel:
            stub = pb2_grpc.TranslatorStub(channel)

            def call(batch: list[str], beam: int) -> None:
                stub.Translate(pb2.TranslateRequest(model=NAME, texts=batch, options=pb2.DecodingOptions(
                    beam_size=beam, max_length=MAX_LENGTH * 3)), timeout=300)

            call(texts, 4)
            burst = tree_rss(process.pid)
            samples, done, counts = [burst], threading.Event(), [0] * callers
            deadline = time.perf_counter() + seconds

            def caller(index: int) -> None:
                draw = random.Random(index)
                while time.perf_counter() < deadline:
                    batch = draw.sample(long, 4) if draw.random() < 0.5 else [draw.choice(texts)]
                    call(batch, draw.choice((1, 4)))
                    counts[index] += len(batch)

            def sample() -> None:
                while not done.wait(0.25):
                    samples.append(tree_rss(process.pid))

            sampler = threading.Thread(target=sample, daemon=True)
            sampler.start()
            start = time.perf_counter()
            threads = [threading.Thread(target=caller, args=(i,)) for i in range(callers)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            elapsed = time.perf_counter() - start
            done.set()
            sampler.join()
        return ServerMemory(empty, loaded, burst, max(samples), tree_rss(process.pid), sum(counts) / elapsed)
    finally:
        process.terminate()
        process.wait(30)


def generate_ids(directory: Path, texts: list[str], beam: int) -> list[list[int]]:
    """``generate`` token ids without decoder start, EOS, padding and language token, each sentence under the
    serving search's length cap (:func:`max_target_length` of its source, EOS and a language token included); an
    NLLB directory under its tokenizer's source language and ``deu_Latn`` (the version's default pair)."""
    import torch
    from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

    model = AutoModelForSeq2SeqLM.from_pretrained(directory).eval()
    tokenizer = AutoTokenizer.from_pretrained(directory)
    many = model.config.model_type == "m2m_100"
    forced = dict(forced_bos_token_id=tokenizer.convert_tokens_to_ids("deu_Latn"), early_stopping=False,
                  forced_eos_token_id=model.config.eos_token_id) if many else {}
    special = {model.config.pad_token_id, model.config.eos_token_id, model.config.decoder_start_token_id}
    ids = []
    for text in texts:
        batch = tokenizer([text], return_tensors="pt")
        cap = max_target_length(batch["input_ids"].shape[1], MAX_LENGTH + many)  # the engine's, language token in
        with torch.no_grad():
            output = model.generate(**batch, num_beams=beam, do_sample=False, max_length=cap + 1,
                                    length_penalty=1.0, **forced)
        ids.append([int(i) for i in output[0][1 + many:] if int(i) not in special])  # after start and language
    return ids


def engine_ids(version: Path, texts: list[str], beam: int) -> list[list[int]]:
    """The serving engine's token ids for ``texts`` at ``beam`` (max length as generate's)."""
    from server.engine.engine import Engine

    engine = Engine.load(version, provider="cpu", intra_op_threads=2, inter_op_threads=1)
    options = dataclasses.replace(engine.default_options(), beam_size=beam, length_penalty=1.0,
                                  max_length=MAX_LENGTH + bool(engine.manifest.language_tokens))
    return [list(translation.hypotheses[0].token_ids) for translation in engine.translate(texts, options)]


def prepack_speed(version: Path, texts: list[str], repeats: int) -> list[str]:
    """Table rows: median time to translate all the texts with each ``--ort-prepack`` choice, greedy and beam 4,
    with and without attention (which runs the attention decoder), runs alternating; against "all"."""
    from server.config import PREPACK
    from server.engine.engine import Engine

    engines = {choice: Engine.load(version, provider="cpu", intra_op_threads=2, inter_op_threads=1, prepack=choice)
               for choice in PREPACK}
    rows = []
    for attention in (False, True):
        for beam in (1, 4):
            times: dict[str, list[float]] = {choice: [] for choice in engines}
            for _ in range(repeats):
                for choice, engine in engines.items():
                    options = dataclasses.replace(engine.default_options(), beam_size=beam, max_length=MAX_LENGTH,
                                                  return_attention=attention)
                    start = time.perf_counter()
                    engine.translate(texts, options)
                    times[choice].append(time.perf_counter() - start)
            median = {choice: statistics.median(spans) for choice, spans in times.items()}
            rows.append(f"| beam {beam}{', attention' if attention else ''} | "
                        + " | ".join(f"{median[c] * 1000:,.0f} ms ({median[c] / median['all']:.2f}x)" for c in PREPACK)
                        + " |")
    return rows


def controls_speed(version: Path, texts: list[str], repeats: int) -> list[str]:
    """Table rows: output tokens/s of the engine without controls and with each of :data:`CONTROLS`, greedy and
    beam 4 over all the texts, runs alternating; the ratio of the medians."""
    from server.controls import Controls
    from server.engine.engine import Engine

    engine = Engine.load(version, provider="cpu", intra_op_threads=2, inter_op_threads=1)
    rows = []
    for beam in (1, 4):
        cells = {"none": Controls(), **{name: Controls(**given) for name, given in CONTROLS.items()}}
        rates: dict[str, list[float]] = {name: [] for name in cells}
        for _ in range(repeats):
            for name, controls in cells.items():
                options = dataclasses.replace(engine.default_options(), beam_size=beam, max_length=MAX_LENGTH,
                                              controls=controls)
                start = time.perf_counter()
                translations = engine.translate(texts, options)
                elapsed = time.perf_counter() - start
                rates[name].append(sum(len(t.hypotheses[0].token_ids) for t in translations) / elapsed)
        plain = statistics.median(rates["none"])
        rows += [f"| {name} | {beam} | {statistics.median(rates[name]):,.0f} | {plain:,.0f} | "
                 f"{statistics.median(rates[name]) / plain:.2f}x |" for name in CONTROLS]
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="OPUS")
    parser.add_argument("--work", help="keep the Marian directory and the repository here (default: a temp dir)")
    parser.add_argument("--repeats", type=int, default=5, help="runs of each side in the engine comparisons")
    parser.add_argument("--load-seconds", type=float, default=120.0, help="sustained load per server setting")
    parser.add_argument("--callers", type=int, default=8, help="concurrent callers of the sustained load")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-export-") as scratch:
        work = Path(args.work or scratch)
        build = build_nllb if args.size.startswith("NLLB") else build_marian
        marian, texts = build(work / "source", args.size)
        checkpoint = (marian / "model.safetensors").stat().st_size
        repository = work / "models"
        seconds, peak, peak_sum, timed = peak_rss_run([
            sys.executable, "-m", "nmt", "export", str(marian), "--name", NAME, "--model-repository", str(repository),
            "--no-progress", "--force", "--version", "1", "--target-language", "deu_Latn"])
        if timed is not None and abs(peak - timed) > 0.05 * timed:
            raise SystemExit(f"the sampled peak of the export's largest process ({peak >> 20} MiB) is not within 5 % "
                             f"of GNU time's ({timed >> 20} MiB): the sampler missed memory")
        version = repository / NAME / "1"
        written = sum(path.stat().st_size for path in version.iterdir() if path.is_file())
        weights = (version / "weights.bin").stat().st_size
        memory = {flags: server_memory(repository, texts, flags.split(), args.load_seconds, args.callers)
                  for flags in MEMORY_FLAGS}
        matches = {beam: sum(a == b for a, b in zip(engine_ids(version, texts, beam), generate_ids(marian, texts, beam),
                                                    strict=True))
                   for beam in (1, 4)}
        speed = prepack_speed(version, texts, args.repeats)
        controls = controls_speed(version, texts, args.repeats)
        manifest = json.loads((version / "manifest.json").read_text())
        mib = 2**20
        print(f"\n{host()}; model {args.size} {SIZES[args.size]}, checkpoint {checkpoint / mib:.0f} MiB, the "
              f"version's weights {weights / mib:.0f} MiB")
        print("| measure | value | against the checkpoint | goal |\n|---|---|---|---|")
        print(f"| export wall time | {seconds:.0f} s | | |")
        print(f"| export peak RSS, its processes summed (sampled every 20 ms) | {peak_sum / mib:,.0f} MiB | "
              f"{peak_sum / checkpoint:.2f}x | <= 3x |")
        print(f"| export peak RSS, its largest process (VmHWM; GNU time: "
              f"{f'{timed / mib:,.0f} MiB' if timed else 'not installed'}) | {peak / mib:,.0f} MiB | "
              f"{peak / checkpoint:.2f}x | |")
        print(f"| version bytes | {written / mib:,.0f} MiB | {written / checkpoint:.2f}x | <= 1.1x |")
        print(f"| greedy / beam 4 equal to generate | {matches[1]}/{len(texts)}, {matches[4]}/{len(texts)} | | all |")
        print(f"parity recorded by the export: {manifest['parity']}")
        print(f"\nServer RSS, MiB (its processes summed; x: against the version's weights); sustained: "
              f"{args.callers} callers for {args.load_seconds:.0f} s, beam 1 or 4, one sentence or four long ones")
        print("| flags | --engine null | loaded | after a burst | sustained peak | at the end | sentences/s |\n"
              "|---|---|---|---|---|---|---|")
        for flags, m in memory.items():
            cells = " | ".join(f"{value / mib:,.0f} ({value / weights:.2f}x)"
                               for value in (m.loaded, m.burst, m.peak, m.end))
            print(f"| {flags or '(defaults)'} | {m.empty / mib:,.0f} | {cells} | {m.sentences_per_second:.1f} |")
        print("\n| all 20 sentences (CPU, 2 threads) | --ort-prepack main | all | none |\n|---|---|---|---|")
        print("\n".join(speed))
        print("\n| control | beam | tokens/s with it | without | ratio |\n|---|---|---|---|---|")
        print("\n".join(controls))


if __name__ == "__main__":
    main()
