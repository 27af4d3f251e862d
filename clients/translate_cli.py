"""``nmt translate``: translate texts with a running ``nmt serve``, list its models, draw alignments.

Only the standard library is imported to build the parser, so ``nmt translate --help`` is fast; grpc
and the client load when the command runs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any, TextIO

DEFAULT_SERVER = "127.0.0.1:50051"
SERVER_ENV = "NMT_SERVER"
TOKEN_ENV = "NMT_TOKEN"
CA_CERT_ENV = "NMT_CA_CERT"
CLIENT_CERT_ENV = "NMT_CLIENT_CERT"
CLIENT_KEY_ENV = "NMT_CLIENT_KEY"
BATCH_SIZE = 32  # texts per request when reading stdin (the server's default limit is 64)

DESCRIPTION = f"""\
Translate texts with a running translation server (nmt serve). Texts come from the arguments, else
from stdin, one per line (blank lines skipped; sent in requests of up to {BATCH_SIZE} lines). With
--file or --format, each input (a TEXT, the file, or all of stdin) is one document: cut into sentences,
its markup kept (--format html|xml), and the translated document is written out as it is.

Output: one translation per line; with --num-hypotheses above 1, --scores or --attention, the numbered
hypotheses of each text with their scores, and with --attention the alignment grid (target words as
rows, source words as columns, cells shaded by attention weight, [bracketed]: the hard alignment) and
the Pharaoh alignments ("source-target" pairs). --json prints one JSON object per text instead.
Errors print "nmt translate: error: <STATUS>: <message>" and exit with status 2.

examples:
  nmt translate "Tuesday, April 25, 2045" --model demo-transformer --beam-size 4 --num-hypotheses 3 --attention
  nmt translate --plot alignment.png "Tuesday, April 25, 2045"
  nmt translate --prefix "Dienstag, 25. Apr" --alternatives 5 "Tuesday, April 25, 2045"   # next-word suggestions
  nmt translate --stream --beam-size 4 "Tuesday, April 25, 2045"        # words as they are decided
  nmt translate --json < sentences.txt > translations.jsonl
  nmt translate --file page.html --format html > page.de.html          # a document, its markup kept
  nmt translate --format text < ticket.txt                               # paragraphs, gaps kept exactly
  nmt translate --list-models
  nmt translate --server 10.0.0.1:50051,10.0.0.2:50051 "one two"          # round robin over two replicas
  nmt translate --server dns:///translator.nmt.svc.cluster.local:50051 "one two"   # a headless Service
  NMT_TOKEN=... nmt translate --server translate.example.com:443 --ca-cert ca.pem "one two"
  nmt translate --ca-cert ca.pem --client-cert client.pem --client-key client.key "one two"   # mutual TLS
"""


def _count(value: str) -> int:
    try:
        number = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {value!r}") from None
    if number < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {number}")
    return number


def _seconds(value: str) -> float:
    try:
        number = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {value!r}") from None
    if not number > 0:
        raise argparse.ArgumentTypeError(f"must be more than 0, got {value}")
    return number


def _penalty(value: str) -> float:
    try:
        number = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {value!r}") from None
    if not 0 <= number < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {value}")
    return number


def add_connection_arguments(parser: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    """The "server" argument group (address, TLS, token, timeout) that every client command shares."""
    server = parser.add_argument_group("server")
    server.add_argument("--server", default=os.environ.get(SERVER_ENV) or DEFAULT_SERVER, metavar="HOST:PORT",
                        help=f"server address; several replicas: comma-separated host:port or "
                             f"dns:///name:port (gRPC round_robin per call, health-checked) [env {SERVER_ENV}; "
                             f"default: {DEFAULT_SERVER}]")
    server.add_argument("--tls", action="store_true", help="connect with TLS (system root certificates)")
    server.add_argument("--ca-cert", metavar="PEM", default=os.environ.get(CA_CERT_ENV) or None,
                        help=f"CA certificates that signed the server's certificate (implies --tls) "
                             f"[env {CA_CERT_ENV}]")
    server.add_argument("--client-cert", metavar="PEM", default=os.environ.get(CLIENT_CERT_ENV) or None,
                        help="this client's certificate chain, for a server that requires mutual TLS (with "
                             f"--client-key; implies --tls) [env {CLIENT_CERT_ENV}]")
    server.add_argument("--client-key", metavar="PEM", default=os.environ.get(CLIENT_KEY_ENV) or None,
                        help=f"the private key of --client-cert [env {CLIENT_KEY_ENV}]")
    server.add_argument("--token", default=os.environ.get(TOKEN_ENV) or None, metavar="TOKEN",
                        help="bearer token for a server with authentication, sent as 'authorization: Bearer "
                             f"TOKEN' metadata [env {TOKEN_ENV}: prefer it, a flag shows in the process list]")
    server.add_argument("--timeout", type=_seconds, default=30.0, metavar="SECONDS",
                        help="deadline of each request, retries included (default: 30)")
    return server


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register the ``translate`` subcommand."""
    parser = subparsers.add_parser(
        "translate",
        help="translate texts with a running server (the client)",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("texts", nargs="*", metavar="TEXT", help="texts to translate (default: lines of stdin)")
    server = add_connection_arguments(parser)
    server.add_argument("--list-models", action="store_true", help="print the server's models and exit")
    server.add_argument("--list-languages", action="store_true",
                        help="print the served language pairs, each with its model, and exit")
    server.add_argument("--health", nargs="?", const="", metavar="MODEL",
                        help="print the gRPC health status of the server (or of MODEL) and exit: status 0 when "
                             "SERVING, 1 otherwise (a container or Kubernetes probe)")
    decoding = parser.add_argument_group("decoding (0: the model's default)")
    decoding.add_argument("--model", default="", help="model name (default: the server's default model)")
    decoding.add_argument("--version", "--model-version", dest="model_version", default="", metavar="VERSION",
                          help="model version (default: the newest)")
    decoding.add_argument("--beam-size", "--beam", dest="beam_size", type=_count, default=0, metavar="N",
                          help="beam size (1: greedy)")
    decoding.add_argument("--num-hypotheses", "--n-best", dest="num_hypotheses", type=_count, default=0, metavar="N",
                          help="hypotheses per text, at most the beam size (default: 1)")
    decoding.add_argument("--max-length", type=_count, default=0, metavar="N", help="most generated tokens")
    decoding.add_argument("--length-penalty", type=_penalty, default=0.0, metavar="ALPHA",
                          help="score = log-probability / length^ALPHA")
    decoding.add_argument("--from", "--source-language", dest="source_language", default="", metavar="LANG",
                          help="the texts' language, or auto to detect it: with --to, and no --model, the server "
                               "chooses the model of that pair (--list-languages shows the pairs)")
    decoding.add_argument("--to", "--target-language", dest="target_language", default="", metavar="LANG",
                          help="the output language (a multilingual model's, e.g. deu; --list-models shows the "
                               "choices)")
    decoding.add_argument("--prefix", default="", metavar="TEXT",
                          help="target prefix: every translation starts with TEXT and continues from it (a TEXT "
                               "ending inside a word, e.g. 'Dienstag, 25. Apr', has that word completed)")
    decoding.add_argument("--alternatives", type=_count, default=0, metavar="N",
                          help="the N most likely next words after --prefix (or at the start), each continued "
                               "to a whole translation, in the order of that word's probability (its log-probability "
                               "is the score; fewer when the others are under 1%% of the first's probability)")
    terms = parser.add_argument_group("terminology")
    terms.add_argument("--glossary", metavar="FILE",
                       help="a glossary file (.tsv: source<TAB>target[<TAB>ci] per line; .csv with commas): every "
                            "translation writes each source term found as its target")
    terms.add_argument("--glossary-id", default="", metavar="ID",
                       help="a glossary stored on the server (its language pair must be the model's)")
    terms.add_argument("--keep", dest="do_not_translate", action="append", default=[], metavar="TERM",
                       help="a term kept as it is in the translation (repeatable)")
    document = parser.add_argument_group("documents")
    document.add_argument("--file", metavar="PATH",
                          help="translate the whole file as one document ('-': stdin); implies --format text "
                               "unless --format says otherwise")
    document.add_argument("--format", dest="text_format", choices=("text", "html", "xml"), default=None,
                          help="read each input as one document of this format: plain text (placeholders such "
                               "as {0} and %%s kept), HTML or XML (markup carried to the translation)")
    document.add_argument("--split", dest="splitting", choices=("sentences", "no_newlines", "off"),
                          default="", help="how a document is cut into sentences: at sentence ends and newlines "
                                           "(default), at sentence ends but not single newlines, or not at all")
    decoding.add_argument("--score", metavar="TARGET", default=None,
                          help="score TARGET as the translation of the one TEXT (kept for scripts; `nmt score "
                               "SOURCE TARGET` is the command for it)")
    output = add_output_arguments(parser)
    output.add_argument("--scores", action="store_true", help="print the hypotheses' scores")
    output.add_argument("--stream", action="store_true",
                        help="print each translation's words as the server decides them (TranslateStreaming: "
                             "greedy decoding shows every word as it is chosen, beam search the words all its "
                             "beams agree on), then the rest of the output; one text per request")
    parser.set_defaults(func=run)
    return parser


def add_output_arguments(parser: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    """The "output" argument group shared by ``nmt translate`` and ``nmt score``."""
    output = parser.add_argument_group("output")
    output.add_argument("--attention", action="store_true",
                        help="print the alignment grid and Pharaoh alignments of each hypothesis")
    output.add_argument("--plot", metavar="FILE",
                        help="write the best hypothesis' attention heatmap: .png, .svg, .pdf (matplotlib) or "
                             ".html; several texts: FILE-1.png, FILE-2.png...")
    output.add_argument("--json", action="store_true", help="one JSON object per text (JSON lines)")
    return output


# ---- input ---------------------------------------------------------------------------------------------------


def _batches(texts: list[str] | Iterator[str], size: int) -> Iterator[list[str]]:
    batch: list[str] = []
    for text in texts:
        batch.append(text)
        if len(batch) >= size:
            yield batch
            batch = []
    if batch:
        yield batch


def _stdin_lines(stream: TextIO) -> Iterator[str]:
    for line in stream:
        if line.strip():
            yield line.rstrip("\r\n")


def read_input(args: argparse.Namespace, stdin: TextIO) -> tuple[list[str] | Iterator[str], int, bool]:
    """Texts, request size, and whether plots are numbered.

    Arguments and piped stdin are read at once; an interactive terminal is translated line by line.
    """
    from common.errors import NmtError

    if args.file is not None:
        if args.texts:
            raise NmtError("--file translates one file: leave out the TEXT arguments")
        text = stdin.read() if args.file == "-" else _read_file(args.file)
        if not text.strip():
            raise NmtError(f"--file {args.file}: nothing to translate")
        return [text], 1, False
    if args.texts:
        return list(args.texts), BATCH_SIZE, len(args.texts) > 1
    if args.text_format is not None:
        text = stdin.read()
        if not text.strip():
            raise NmtError("no text to translate: pass TEXT arguments or a document on stdin")
        return [text], 1, False
    interactive = bool(getattr(stdin, "isatty", lambda: False)())
    if interactive:
        return _stdin_lines(stdin), 1, True
    texts = list(_stdin_lines(stdin))
    if not texts:
        raise NmtError("no text to translate: pass TEXT arguments or lines on stdin")
    return texts, BATCH_SIZE, len(texts) > 1


def _read_file(path: str) -> str:
    from common.errors import NmtError

    try:
        return Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise NmtError(f"--file {path}: {error}") from None


# ---- output --------------------------------------------------------------------------------------------------


def _unicode_ok(stream: TextIO) -> bool:
    try:
        "░▒▓█…".encode(getattr(stream, "encoding", None) or "ascii")
    except (UnicodeEncodeError, LookupError):
        return False
    return True


def _indent(text: str, prefix: str) -> str:
    return "\n".join(prefix + line if line else line for line in text.splitlines())


def format_translation(source: str, translation: Any, *, verbose: bool, attention: bool, ascii_only: bool,
                       legend: bool = True) -> str:
    """The text output of one translation (``verbose``: the source, numbered hypotheses, scores, grids;
    ``legend``: explain the shades under the first grid)."""
    from clients.render import alignment_grid

    if not verbose:
        return translation.hypotheses[0].text if translation.hypotheses else ""
    lines = [f"> {source}"]
    for rank, hypothesis in enumerate(translation.hypotheses, start=1):
        score = f"  (score {hypothesis.score:.4f})" if hypothesis.score is not None else ""
        lines.append(f"{rank}. {hypothesis.text or '(empty: the translation ends here)'}{score}")
        if attention and hypothesis.attention is not None:
            lines.append(f"   alignment: {hypothesis.attention.pharaoh}")
            grid = alignment_grid(hypothesis.attention, ascii_only=ascii_only, legend=legend)
            lines.append(_indent(grid, "   "))
            legend = False
    return "\n".join(lines) + "\n"


def translation_json(source: str, translation: Any) -> dict[str, Any]:
    """One text's result as a JSON-ready dict; absent scores and attention (and terms_missed unless set) are left
    out."""
    hypotheses = []
    for hypothesis in translation.hypotheses:
        entry = {k: v for k, v in asdict(hypothesis).items() if v is not None and (k != "terms_missed" or v)}
        if "attention" in entry:
            entry["attention"]["alignments"] = [list(pair) for pair in entry["attention"]["alignments"]]
        hypotheses.append(entry)
    result = {"text": source, "model": translation.model, "model_version": translation.model_version,
              "source_tokens": translation.source_tokens, "hypotheses": hypotheses}
    if len(translation.segments) > 1:
        result["segments"] = [{"source": list(s.source), "target": list(s.target)} for s in translation.segments]
    if translation.terms:
        result["terms"] = [{"source": source_term, "target": target} for source_term, target in translation.terms]
    if translation.word_alignments:
        result["word_alignments"] = [list(pair) for pair in translation.word_alignments]
    if translation.detected_language:
        result["detected_language"] = {"language": translation.detected_language,
                                       "confidence": translation.detected_confidence}
    return result


def plot_path(base: str, index: int, numbered: bool) -> Path:
    """``out.png`` for a single text, ``out-<index>.png`` (1-based) for several."""
    path = Path(base)
    return path if not numbered else path.with_name(f"{path.stem}-{index}{path.suffix}")


def format_models(models: list[Any]) -> str:
    """A table of ``ModelInfo``."""
    header = ("MODEL", "VERSION", "ARCHITECTURE", "LANGUAGES", "PROVIDER", "PRECISION", "BEAM", "BLEU",
              "CORPUS", "")
    rows = [header]
    for m in models:
        flags = ", ".join(flag for flag, on in (("default", m.is_default and m.is_latest), ("latest", m.is_latest))
                          if on)
        targets = ",".join(getattr(m, "target_languages", ())) or m.target_language
        rows.append((m.name, m.version, m.architecture, f"{m.source_language}→{targets}",
                     m.execution_provider, m.precision, f"{m.default_beam_size}/{m.max_beam_size}",
                     f"{m.test_bleu:.1f}" if m.test_bleu else "-", m.training_corpus or "-", flags))
    widths = [max(len(str(row[i])) for row in rows) for i in range(len(header))]
    return "\n".join("  ".join(str(v).ljust(w) for v, w in zip(row, widths, strict=True)).rstrip() for row in rows)


# ---- the command ---------------------------------------------------------------------------------------------


def connect(args: argparse.Namespace) -> Any:
    """A :class:`clients.client.TranslatorClient` for the connection arguments (a context manager); checks
    ``--plot``'s format first."""
    from clients.client import TranslatorClient
    from clients.render import FORMATS
    from common.errors import NmtError

    if args.plot and Path(args.plot).suffix.lower() not in FORMATS:
        raise NmtError(f"--plot {args.plot}: use one of {', '.join(FORMATS)}")
    if bool(args.client_cert) != bool(args.client_key):
        raise NmtError("--client-cert and --client-key go together (mutual TLS needs the certificate and its key)")
    tls = args.tls or bool(args.ca_cert) or bool(args.client_cert)
    return TranslatorClient(args.server, timeout=args.timeout, tls=tls, root_certificates=args.ca_cert,
                            client_cert=args.client_cert, client_key=args.client_key, token=args.token)


def print_translation(args: argparse.Namespace, source: str, translation: Any, index: int, *, numbered: bool,
                      verbose: bool, stdout: TextIO, stderr: TextIO) -> None:
    """One text's result as ``--json``, text (``verbose``: numbered hypotheses, scores, grids) and ``--plot``."""
    if args.json:
        print(json.dumps(translation_json(source, translation), ensure_ascii=False), file=stdout)
    else:
        print(format_translation(source, translation, verbose=verbose, attention=args.attention,
                                 ascii_only=not _unicode_ok(stdout), legend=index == 1), file=stdout)
    save_plot(args, translation, index, numbered=numbered, stderr=stderr)


def save_plot(args: argparse.Namespace, translation: Any, index: int, *, numbered: bool, stderr: TextIO) -> None:
    """``--plot``: the best hypothesis' attention heatmap, when it has attention."""
    from clients.render import save_heatmap

    if args.plot and translation.hypotheses and translation.hypotheses[0].attention is not None:
        path = save_heatmap(translation.hypotheses[0].attention, plot_path(args.plot, index, numbered))
        print(f"wrote {path}", file=stderr)


def run(args: argparse.Namespace, *, stdin: TextIO | None = None, stdout: TextIO | None = None,
        stderr: TextIO | None = None) -> int:
    from common.errors import NmtError

    stdin, stdout, stderr = stdin or sys.stdin, stdout or sys.stdout, stderr or sys.stderr
    with connect(args) as client:
        if args.health is not None:
            status = client.health(args.health)
            print(status, file=stdout)
            return 0 if status == "SERVING" else 1
        if args.list_models:
            models = client.list_models()
            if args.json:
                for model in models:
                    print(json.dumps(asdict(model), ensure_ascii=False), file=stdout)
            else:
                print(format_models(models), file=stdout)
            return 0
        if args.list_languages:
            for source, target, model in client.list_languages():
                line = json.dumps({"source": source, "target": target, "model": model}) if args.json else (
                    f"{source}\t{target}\t{model}")
                print(line, file=stdout)
            return 0

        glossary = read_glossary(args.glossary) if args.glossary else ()
        texts, batch_size, numbered = read_input(args, stdin)
        if args.score is not None and (not isinstance(texts, list) or len(texts) != 1):
            raise NmtError("--score TARGET scores one text: give that text as the only TEXT argument")
        hypotheses = args.alternatives or args.num_hypotheses
        scores = args.scores or hypotheses > 1
        attention = args.attention or bool(args.plot)
        verbose = hypotheses > 1 or args.scores or args.attention or args.score is not None
        if args.stream and (args.score is not None or args.alternatives or args.json):
            raise NmtError("--stream prints words as they come: not with --score, --alternatives or --json")
        documents = args.file is not None or args.text_format is not None
        if documents and (args.stream or args.score is not None or args.prefix or args.alternatives):
            raise NmtError("--file and --format translate documents: not with --stream, --score, --prefix or "
                           "--alternatives, which apply to one sentence")
        text_format = args.text_format or ("text" if documents else "")
        index = 0
        for batch in _batches(texts, 1 if args.stream else batch_size):
            if args.stream:
                results = [stream_one(client, args, batch[0], hypotheses, scores, attention, stdout, verbose)]
            elif args.score is not None:
                results = client.score(batch, [args.score], model=args.model, version=args.model_version,
                                       attention=attention, length_penalty=args.length_penalty,
                                       target_language=args.target_language)
            else:
                results = client.translate(batch, model=args.model, version=args.model_version,
                                           beam_size=args.beam_size, num_hypotheses=hypotheses,
                                           max_length=args.max_length, length_penalty=args.length_penalty,
                                           attention=attention, scores=scores, target_language=args.target_language,
                                           target_prefixes=[args.prefix] * len(batch) if args.prefix else (),
                                           alternatives=bool(args.alternatives), text_format=text_format,
                                           splitting=args.splitting, source_language=args.source_language,
                                           glossary=glossary, glossary_id=args.glossary_id,
                                           do_not_translate=args.do_not_translate)
            for source, translation in zip(batch, results, strict=True):
                index += 1
                if documents and not verbose and not args.json:  # the document out, as it is
                    text = translation.hypotheses[0].text if translation.hypotheses else ""
                    stdout.write(text if text.endswith("\n") else text + "\n")
                    save_plot(args, translation, index, numbered=numbered, stderr=stderr)
                    continue
                if args.stream and not verbose:  # its words are printed already
                    print(file=stdout)
                    save_plot(args, translation, index, numbered=numbered, stderr=stderr)
                    continue
                print_translation(args, source, translation, index, numbered=numbered, verbose=verbose,
                                  stdout=stdout, stderr=stderr)
            stdout.flush()
    return 0


def stream_one(client: Any, args: argparse.Namespace, text: str, hypotheses: int, scores: bool, attention: bool,
               stdout: TextIO, verbose: bool) -> Any:
    """Translate ``text`` with ``TranslateStreaming``, printing its words as they come (on a line of their
    own when the full output follows); returns the translation."""
    translation = None
    for delta in client.translate_stream(text, model=args.model, version=args.model_version,
                                         beam_size=args.beam_size, num_hypotheses=hypotheses,
                                         max_length=args.max_length, length_penalty=args.length_penalty,
                                         attention=attention, scores=scores, target_language=args.target_language,
                                         target_prefix=args.prefix, source_language=args.source_language,
                                         glossary=read_glossary(args.glossary) if args.glossary else (),
                                         glossary_id=args.glossary_id, do_not_translate=args.do_not_translate):
        print(delta.text, end="", file=stdout, flush=True)
        translation = delta.translation or translation
    if verbose:
        print(file=stdout)
    return translation


def read_glossary(path: str) -> list[tuple[str, str, bool]]:
    """The entries of a glossary file (:mod:`common.glossary_file`)."""
    from common.errors import NmtError
    from common.glossary_file import read_entries

    try:
        return read_entries(Path(path).read_text(encoding="utf-8"), path.endswith(".csv"), path)
    except (OSError, UnicodeDecodeError, ValueError) as error:
        raise NmtError(f"cannot read the glossary {path}: {error}") from error
