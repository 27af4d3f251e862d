"""The translation cache: the in-process layer's bounds and keys, hits through a live server equal to what the
decode returned, and a real Redis (Debian's redis-server on a free port) shared by two ``nmt serve``
processes: a sentence one decoded is a hit on the other, Redis killed under load fails no request and is
used again once back, and a hot-reloaded version never answers with its predecessor's entries."""

from __future__ import annotations

import itertools
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import grpc
import numpy as np
import pytest

from loadtests.cli import free_port
from server.config import ServerConfig
from server.controls import Controls
from server.frontend.cache import MemoryLayer, cacheable, decode_result, encode_result, sentence_key
from server.protos import pb2, pb2_grpc
from server.types import DecodingOptions, ScoredSequence, SearchResult, SentenceRequest, TargetPrefix
from tests.harness import ServerHarness
from tests.test_scale import Replica, launch, serving
from tests.test_server import default_loader

REDIS = shutil.which("redis-server")
needs_redis = pytest.mark.skipif(REDIS is None, reason="redis-server is not installed: apt-get install -y "
                                                       "redis-server (./test.sh does it when run as root)")
MODEL = "dates"
DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
MONTHS = ["January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
          "November", "December"]


def dates(start: int, count: int) -> list[str]:
    """``count`` distinct dates (a different stretch of them for each ``start``)."""
    every = itertools.product(range(1990, 2060), MONTHS, range(1, 29))
    chosen = itertools.islice(every, start, start + count)
    return [f"{DAYS[(year + day) % 7]}, {month} {day}, {year}" for year, month, day in chosen]


# ---- the in-process layer and the keys ---------------------------------------------------------------------

def result(tokens: list[int], attention: bool = False) -> SearchResult:
    weights = np.full((len(tokens), 3), 1 / 3, dtype=np.float32) if attention else None
    return SearchResult([ScoredSequence(tokens, -0.5, [-0.1] * len(tokens), weights)])


def test_memory_layer_is_bounded_in_bytes_least_recently_used_out_first() -> None:
    layer = MemoryLayer(max_bytes=300)
    values = {bytes([i]) * 16: bytes(84) for i in range(3)}  # 100 bytes each, key included
    for key, value in values.items():
        layer.put(key, value)
    assert len(layer) == 3 and layer.bytes == 300
    first, second, third = values
    assert layer.get(first) is not None  # now the most recently used
    layer.put(b"n" * 16, bytes(84))
    assert layer.get(second) is None and layer.get(first) is not None and layer.bytes == 300
    layer.put(b"x" * 16, bytes(400))  # larger than the whole cache: not kept, nothing evicted for it
    assert layer.get(b"x" * 16) is None and len(layer) == 3


def test_the_key_holds_what_changes_the_output_and_not_attention() -> None:
    version, other = b"v" * 16, b"w" * 16
    sentence = SentenceRequest([5, 6, 7], DecodingOptions(beam_size=4))
    key = sentence_key(version, sentence)
    assert sentence_key(version, replace(sentence, options=replace(sentence.options, return_attention=True))) == key
    changed = [
        sentence_key(other, sentence),
        sentence_key(version, replace(sentence, source_ids=[5, 6, 8])),
        sentence_key(version, replace(sentence, options=replace(sentence.options, beam_size=2))),
        sentence_key(version, replace(sentence, options=replace(sentence.options, length_penalty=0.5))),
        sentence_key(version, replace(sentence, options=replace(sentence.options, controls=Controls(min_length=3)))),
        sentence_key(version, replace(sentence, target_prefix=TargetPrefix((9,)))),
    ]
    assert len({key, *changed}) == 1 + len(changed)


def test_unseeded_sampling_and_streamed_sentences_are_not_cached() -> None:
    sampled = DecodingOptions(controls=Controls(sampling_topk=0))
    assert not cacheable(SentenceRequest([1], sampled))
    assert cacheable(SentenceRequest([1], replace(sampled, controls=Controls(sampling_topk=0, seed=7))))
    assert not cacheable(SentenceRequest([1], on_stable=lambda *args: None))


def test_values_round_trip_with_and_without_attention() -> None:
    for value in (result([4, 5, 2]), result([4, 5, 2], attention=True)):
        back = decode_result(encode_result(value))
        assert back.hypotheses[0].tokens == value.hypotheses[0].tokens
        assert (back.hypotheses[0].attention is None) == (value.hypotheses[0].attention is None)
        if value.hypotheses[0].attention is not None:
            assert np.array_equal(back.hypotheses[0].attention, value.hypotheses[0].attention)


# ---- through a live server ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def repository(dates_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("cache") / "models"
    shutil.copytree(dates_models["transformer"], root / MODEL / "1")
    return root


def harness(repository: Path, **settings) -> ServerHarness:
    config = ServerConfig(listen="127.0.0.1:0", metrics_listen="", http_listen="", model_repository=str(repository),
                          provider="cpu", intra_op_threads=1, **settings).validate()
    return ServerHarness(config, default_loader())


@pytest.fixture(scope="module")
def server(repository: Path) -> Iterator[ServerHarness]:
    served = harness(repository)
    yield served
    served.close()


def lookups(server: ServerHarness, layer: str = "memory") -> tuple[float, float]:
    return tuple(server.metric("nmt_cache_lookups_total", {"layer": layer, "result": result})
                 for result in ("hit", "miss"))


def translate(stub: pb2_grpc.TranslatorStub, texts: list[str], **options) -> pb2.TranslateResponse:
    return stub.Translate(pb2.TranslateRequest(texts=texts, model=MODEL, options=pb2.DecodingOptions(**options)),
                          timeout=60)


def test_a_repeated_sentence_is_a_hit_equal_to_its_decode(server: ServerHarness) -> None:
    texts = dates(0, 3)
    hits, misses = lookups(server)
    first = translate(server.stub, texts, beam_size=4, num_hypotheses=2, return_scores=True)
    assert lookups(server) == (hits, misses + 3)
    again = translate(server.stub, texts, beam_size=4, num_hypotheses=2, return_scores=True)
    assert lookups(server) == (hits + 3, misses + 3)
    assert again.translations == first.translations
    other = translate(server.stub, texts[:1], beam_size=2, return_scores=True)  # other options: another entry
    assert lookups(server) == (hits + 3, misses + 4)
    assert other.translations[0].hypotheses[0].score != 0


def test_a_hit_without_attention_serves_no_request_for_attention(server: ServerHarness) -> None:
    [text] = dates(10, 1)
    plain = translate(server.stub, [text], beam_size=4)
    hits, misses = lookups(server)
    attended = translate(server.stub, [text], beam_size=4, return_attention=True)
    assert lookups(server) == (hits, misses + 1) and attended.translations[0].hypotheses[0].attention.weights
    assert translate(server.stub, [text], beam_size=4, return_attention=True).translations == attended.translations
    assert translate(server.stub, [text], beam_size=4).translations == plain.translations  # attention left out
    assert lookups(server) == (hits + 2, misses + 1)


def test_sampling_without_a_seed_is_decoded_every_time(server: ServerHarness) -> None:
    [text] = dates(20, 1)
    before = lookups(server)
    for _ in range(2):
        translate(server.stub, [text], sampling_topk=5)
    assert lookups(server) == before
    translate(server.stub, [text], sampling_topk=5, sampling_seed=3)
    seeded = translate(server.stub, [text], sampling_topk=5, sampling_seed=3)
    assert lookups(server) == (before[0] + 1, before[1] + 1) and seeded.translations


def test_documents_share_their_sentences_entries(server: ServerHarness) -> None:
    first, second = dates(30, 2)
    translate(server.stub, [first, second], beam_size=4)
    hits, misses = lookups(server)
    translate(server.stub, [f"{first}. {second}."], beam_size=4)  # the same sentences, with their full stops
    translate(server.stub, [f"{first}\n{second}"], beam_size=4)  # the same sentences, a text apart
    assert lookups(server)[0] >= hits + 2


def test_no_cache_when_turned_off(repository: Path) -> None:
    served = harness(repository, cache_mb=0)
    try:
        translate(served.stub, dates(40, 1))
        translate(served.stub, dates(40, 1))
        assert served.server.servicer.cache is None and lookups(served) == (0, 0)
    finally:
        served.close()


# ---- a real Redis shared by two server processes ---------------------------------------------------------------

class RedisServer:
    def __init__(self, port: int, directory: Path) -> None:
        self.port, self.directory = port, directory
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.process = subprocess.Popen([REDIS, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                                         "--appendonly", "no", "--dir", str(self.directory)],
                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        import redis

        client = redis.Redis(port=self.port, socket_timeout=1)
        deadline = time.monotonic() + 20
        while True:
            try:
                client.ping()
                return
            except redis.ConnectionError:
                if time.monotonic() > deadline or self.process.poll() is not None:
                    raise
                time.sleep(0.05)

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(10)


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    if REDIS is None:
        pytest.skip("redis-server is not installed")
    server = RedisServer(free_port(), tmp_path)
    server.start()
    yield server
    server.kill()


def replica_metric(replica: Replica, name: str, **labels: str) -> float:
    return sum(s.value for s in replica.samples() if s.name == name and labels.items() <= s.labels.items())


@pytest.fixture
def replicas(repository: Path, redis_server: RedisServer) -> Iterator[list[Replica]]:
    flags = ("--cache-redis", redis_server.url, "--reload-interval", "0.5")
    started = [launch(repository, *flags) for _ in range(2)]
    try:
        started = [serving(replica, repository, *flags) for replica in started]
        yield started
    finally:
        for replica in started:
            if replica.process.poll() is None:
                replica.process.kill()
            replica.process.wait(30)


def stub_of(replica: Replica) -> tuple[grpc.Channel, pb2_grpc.TranslatorStub]:
    channel = grpc.insecure_channel(replica.address)
    return channel, pb2_grpc.TranslatorStub(channel)


def eventually(check, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


@needs_redis
def test_a_sentence_decoded_by_one_replica_is_a_hit_on_the_other(replicas: list[Replica]) -> None:
    (one, one_stub), (other, other_stub) = stub_of(replicas[0]), stub_of(replicas[1])
    texts = dates(100, 4)
    decoded = translate(one_stub, texts, beam_size=4, return_scores=True)
    eventually(lambda: replica_metric(replicas[0], "nmt_cache_lookups_total", layer="redis", result="miss") >= 4)
    time.sleep(0.2)  # the writes go out after the response

    def hits() -> float:
        return replica_metric(replicas[1], "nmt_cache_lookups_total", layer="redis", result="hit")

    assert hits() == 0
    served = translate(other_stub, texts, beam_size=4, return_scores=True)
    assert hits() == 4 and served.translations == decoded.translations
    one.close()
    other.close()


@needs_redis
def test_redis_killed_under_load_fails_no_request_and_is_used_again(replicas: list[Replica],
                                                                    redis_server: RedisServer) -> None:
    channels = [stub_of(r) for r in replicas]
    failures: list[BaseException] = []
    stop = threading.Event()
    counter = itertools.count(1000, 8)

    def load() -> None:  # fresh sentences decoded on one replica, then asked of the other
        while not stop.is_set():
            texts = dates(next(counter), 8)
            try:
                translate(channels[0][1], texts, beam_size=2)
                translate(channels[1][1], texts, beam_size=2)
            except grpc.RpcError as error:
                failures.append(error)

    def redis_hits() -> float:
        return replica_metric(replicas[1], "nmt_cache_lookups_total", layer="redis", result="hit")

    with ThreadPoolExecutor(4) as pool:
        workers = [pool.submit(load) for _ in range(4)]
        eventually(lambda: redis_hits() > 0, 30)
        redis_server.kill()
        eventually(lambda: replica_metric(replicas[1], "nmt_cache_errors_total", layer="redis") > 0, 30)
        time.sleep(1.0)
        down = redis_hits()
        time.sleep(1.0)
        assert redis_hits() == down  # nothing comes from a dead Redis
        redis_server.start()
        eventually(lambda: redis_hits() > down, 45)  # the back-off is at most 30 s
        stop.set()
        for worker in workers:
            worker.result(60)
    assert not failures
    for channel, _ in channels:
        channel.close()


@needs_redis
def test_a_hot_reloaded_version_never_answers_with_its_predecessors_entries(
        repository: Path, dates_models: dict[str, Path], redis_server: RedisServer, tmp_path: Path) -> None:
    root = tmp_path / "models"
    shutil.copytree(repository / MODEL / "1", root / MODEL / "1")
    flags = ("--cache-redis", redis_server.url, "--reload-interval", "0.5")
    replica = serving(launch(root, *flags), root, *flags)
    channel, stub = stub_of(replica)
    try:
        texts = dates(5000, 3)
        old = translate(stub, texts, beam_size=4, return_scores=True)
        assert translate(stub, texts, beam_size=4, return_scores=True).translations == old.translations
        staged = tmp_path / "staged"
        shutil.copytree(dates_models["bahdanau"], staged)
        manifest = (staged / "manifest.json").read_text().replace('"dates-bahdanau"', f'"{MODEL}"')
        (staged / "manifest.json").write_text(manifest)
        shutil.rmtree(root / MODEL / "1")
        shutil.move(staged, root / MODEL / "1")

        def reloaded() -> bool:
            response = stub.ListModels(pb2.ListModelsRequest(), timeout=10)
            return any(m.architecture == "bahdanau" for m in response.models)

        eventually(reloaded, 60)
        new = translate(stub, texts, beam_size=4, return_scores=True)
        fresh = harness(root, cache_mb=0)
        try:
            assert new.translations == translate(fresh.stub, texts, beam_size=4, return_scores=True).translations
        finally:
            fresh.close()
        assert [t.hypotheses[0].score for t in new.translations] != [t.hypotheses[0].score for t in old.translations]
    finally:
        channel.close()
        replica.process.kill()
        replica.process.wait(30)
