"""The translation cache: one sentence's search result, kept per model version, in this process and optionally
in a Redis shared by replicas.

It sits in front of a version's ``submit`` (:func:`server.frontend.translate.translate_texts` and documents
call it), so every sentence a scheduler would decode is looked up first, and only the misses are decoded.

**Key.** The version's content (its name, its files' digests, the execution provider and precision: a re-export
or a hot-reloaded version with other files never meets its predecessor's entries), the sentence's source token
ids (the target-language token included), its target prefix and every decoding option that changes the output
(beam, n-best, lengths, length penalty, patience, controls, the sampling seed), hashed with BLAKE2b.
Attention is not in the key: an entry holds it when it was computed, and a request that asks for attention
misses an entry without it (the decoded result, with attention, then takes the entry's place). Not cached:
sampling without a seed (every call should draw anew) and streamed sentences (their words are reported as the
search goes).

**Value.** The :class:`server.types.SearchResult` as MessagePack (:mod:`server.ipc`'s encoding, arrays as raw
bytes): what the in-process layer stores and bounds in bytes, and what Redis holds.

**Layers.** :class:`MemoryLayer`, a least-recently-used map bounded in bytes, then :class:`RedisLayer`: one
``MGET`` per request's missing keys under a short timeout (:data:`REDIS_TIMEOUT`), writes sent after the
response without waiting. Redis unreachable or slow means serving without it: the failure is logged once and
counted, and Redis is tried again after a back-off that doubles up to :data:`REDIS_BACKOFF_MAX`.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
import weakref
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import msgspec

from server.ipc import decode_hook, encode_hook
from server.policy import RequestHandle
from server.types import DecodingOptions, ScoredSequence, SearchResult, SentenceRequest, TargetPrefix

log = logging.getLogger("nmt.server")

REDIS_TIMEOUT = 0.05  # seconds a request waits for Redis at most; beyond it, it decodes as without a cache
REDIS_BACKOFF = 1.0  # seconds before Redis is tried again after a failure (doubling)
REDIS_BACKOFF_MAX = 30.0
KEY_PREFIX = b"nmt:1:"  # Redis keys: this, then the version's digest and the sentence's

_ENCODER = msgspec.msgpack.Encoder(enc_hook=encode_hook)
_DECODER = msgspec.msgpack.Decoder(SearchResult, dec_hook=decode_hook)
_KEY_ENCODER = msgspec.msgpack.Encoder(enc_hook=encode_hook)


def version_digest(model: Any) -> bytes:
    """What identifies a served version's outputs: its name, version, files (their digests), execution
    provider and precision."""
    manifest = model.manifest
    files = sorted((getattr(manifest, "files", None) or {}).items())
    identity = (model.name, model.version, files, getattr(model, "provider", ""),
                str(getattr(manifest, "precision", "")))
    return hashlib.blake2b(_KEY_ENCODER.encode(identity), digest_size=16).digest()


def cacheable(sentence: SentenceRequest) -> bool:
    controls = sentence.options.controls
    return sentence.on_stable is None and not (controls.samples and controls.seed == 0)


def sentence_key(version: bytes, sentence: SentenceRequest) -> bytes:
    """The entry's key (module docstring): ``version`` then a digest of what changes the result."""
    options: DecodingOptions = replace(sentence.options, return_attention=False)
    prefix: TargetPrefix = sentence.target_prefix
    digest = hashlib.blake2b(_KEY_ENCODER.encode((sentence.source_ids, sentence.source_end, options, prefix)),
                             digest_size=16)
    return version + digest.digest()


def encode_result(result: SearchResult) -> bytes:
    return _ENCODER.encode(result)


def decode_result(value: bytes) -> SearchResult:
    return _DECODER.decode(value)


def has_attention(result: SearchResult) -> bool:
    return all(h.attention is not None for h in result.hypotheses)


def without_attention(result: SearchResult) -> SearchResult:
    return SearchResult([ScoredSequence(h.tokens, h.score, h.token_scores, terms_met=h.terms_met)
                         for h in result.hypotheses])


class MemoryLayer:
    """Encoded results by key, least recently used first out, bounded in bytes (keys and values)."""

    name = "memory"

    def __init__(self, max_bytes: int, series: Any = None) -> None:
        self.max_bytes = max_bytes
        self.bytes = 0
        self._entries: OrderedDict[bytes, bytes] = OrderedDict()
        self.series = series  # CacheSeries of this layer, or None

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: bytes) -> bytes | None:
        value = self._entries.get(key)
        if value is not None:
            self._entries.move_to_end(key)
        return value

    def put(self, key: bytes, value: bytes) -> None:
        size = len(key) + len(value)
        if size > self.max_bytes:
            return
        old = self._entries.pop(key, None)
        if old is not None:
            self.bytes -= len(key) + len(old)
        self._entries[key] = value
        self.bytes += size
        evicted = 0
        while self.bytes > self.max_bytes:
            first, dropped = self._entries.popitem(last=False)
            self.bytes -= len(first) + len(dropped)
            evicted += 1
        if self.series is not None:
            self.series.evicted(evicted)
            self.series.size(self.bytes)


class RedisLayer:
    """A Redis shared by replicas (redis-py's asyncio client); see the module docstring for its failures."""

    name = "redis"

    def __init__(self, url: str, ttl: float, series: Any = None) -> None:
        import redis.asyncio

        self.ttl = max(1, round(ttl))
        self.url = url
        self._client = redis.asyncio.Redis.from_url(url, socket_timeout=REDIS_TIMEOUT,
                                                    socket_connect_timeout=REDIS_TIMEOUT, retry_on_timeout=False)
        self.series = series
        self._down_until = 0.0
        self._backoff = REDIS_BACKOFF
        self._down = False
        self._writes: set[asyncio.Task] = set()

    @property
    def up(self) -> bool:
        return time.monotonic() >= self._down_until

    async def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        """Each key's value (None: absent, or Redis not answering in time: then all None)."""
        if not keys or not self.up:
            return [None] * len(keys)
        try:
            values = await asyncio.wait_for(self._client.mget([KEY_PREFIX + k for k in keys]), REDIS_TIMEOUT)
        except Exception as error:  # noqa: BLE001 - any failure of Redis means serving without it
            self._failed(error)
            return [None] * len(keys)
        self._recovered()
        return list(values)

    def put_many(self, entries: Sequence[tuple[bytes, bytes]]) -> None:
        """Write ``entries`` with the TTL in one pipeline, in the background (the response does not wait)."""
        if not entries or not self.up:
            return
        task = asyncio.ensure_future(self._write(entries))
        self._writes.add(task)
        task.add_done_callback(self._writes.discard)

    async def _write(self, entries: Sequence[tuple[bytes, bytes]]) -> None:
        try:
            async with self._client.pipeline(transaction=False) as pipe:
                for key, value in entries:
                    pipe.set(KEY_PREFIX + key, value, ex=self.ttl)
                await asyncio.wait_for(pipe.execute(), 4 * REDIS_TIMEOUT)
        except Exception as error:  # noqa: BLE001
            self._failed(error)
        else:
            self._recovered()

    def _failed(self, error: BaseException) -> None:
        if self.series is not None:
            self.series.error()
        if not self._down:
            log.warning("translation cache: Redis is not answering; serving without it",
                        extra={"fields": {"url": _redacted(self.url), "error": repr(error)[:200]}})
        self._down = True
        self._down_until = time.monotonic() + self._backoff
        self._backoff = min(2 * self._backoff, REDIS_BACKOFF_MAX)

    def _recovered(self) -> None:
        if self._down:
            log.warning("translation cache: Redis answers again", extra={"fields": {"url": _redacted(self.url)}})
        self._down, self._backoff = False, REDIS_BACKOFF

    async def close(self) -> None:
        for task in list(self._writes):
            task.cancel()
        await self._client.aclose()


def _redacted(url: str) -> str:
    """``url`` without a password (``redis://:secret@host`` -> ``redis://***@host``)."""
    scheme, sep, rest = url.partition("://")
    return f"{scheme}{sep}***@{rest.rpartition('@')[2]}" if "@" in rest else url


class TranslationCache:
    """The layers in front of a version's ``submit``."""

    def __init__(self, memory: MemoryLayer | None, redis: RedisLayer | None = None) -> None:
        self.memory = memory
        self.redis = redis
        self._digests: weakref.WeakKeyDictionary[Any, bytes] = weakref.WeakKeyDictionary()  # per loaded version

    @classmethod
    def from_config(cls, config: Any, metrics: Any = None) -> TranslationCache | None:
        """The cache ``--cache-mb`` and ``--cache-redis`` ask for, or None for neither."""
        series = (lambda layer: metrics.cache_series(layer)) if metrics is not None else (lambda layer: None)
        memory = MemoryLayer(config.cache_mb << 20, series("memory")) if config.cache_mb else None
        redis = RedisLayer(config.cache_redis, config.cache_ttl, series("redis")) if config.cache_redis else None
        return cls(memory, redis) if memory is not None or redis is not None else None

    def _count(self, layer: MemoryLayer | RedisLayer, hits: int, misses: int) -> None:
        series = layer.series
        if series is not None:
            if hits:
                series.hits.inc(hits)
            if misses:
                series.misses.inc(misses)

    def through(self, model: Any, submit: Any) -> Any:
        """``submit`` of ``model`` with this cache in front (:data:`server.frontend.translate.Submit`)."""
        version = self._digests.get(model)
        if version is None:
            version = self._digests[model] = version_digest(model)

        async def cached(sentences: Sequence[SentenceRequest], work: Sequence[int],
                         handle: RequestHandle) -> list[SearchResult]:
            results: list[SearchResult | None] = [None] * len(sentences)
            keys: dict[int, bytes] = {i: sentence_key(version, s) for i, s in enumerate(sentences) if cacheable(s)}
            missing = self._lookup_memory(sentences, keys, results)
            if self.redis is not None and missing:
                missing = await self._lookup_redis(sentences, keys, results, missing)
            todo = [i for i in range(len(sentences)) if results[i] is None]
            if todo:
                decoded = await submit([sentences[i] for i in todo], [work[i] for i in todo], handle)
                stored = []
                for i, result in zip(todo, decoded, strict=True):
                    results[i] = result
                    if i in keys and result is not None and result.hypotheses:
                        stored.append((keys[i], encode_result(result)))
                for key, value in stored:
                    if self.memory is not None:
                        self.memory.put(key, value)
                if self.redis is not None:
                    self.redis.put_many(stored)
            return results  # type: ignore[return-value]

        return cached

    def _usable(self, sentence: SentenceRequest, value: bytes | None) -> SearchResult | None:
        if value is None:
            return None
        result = decode_result(value)
        if not sentence.options.return_attention:
            return without_attention(result) if has_attention(result) else result
        return result if has_attention(result) else None

    def _lookup_memory(self, sentences: Sequence[SentenceRequest], keys: dict[int, bytes],
                       results: list[SearchResult | None]) -> list[int]:
        """Fill ``results`` from the memory layer; the cacheable sentences it did not have."""
        if self.memory is None:
            return list(keys)
        missing = []
        for i, key in keys.items():
            results[i] = self._usable(sentences[i], self.memory.get(key))
            if results[i] is None:
                missing.append(i)
        self._count(self.memory, len(keys) - len(missing), len(missing))
        return missing

    async def _lookup_redis(self, sentences: Sequence[SentenceRequest], keys: dict[int, bytes],
                            results: list[SearchResult | None], missing: list[int]) -> list[int]:
        if not self.redis.up:
            return missing
        values = await self.redis.get_many([keys[i] for i in missing])
        left = []
        for i, value in zip(missing, values, strict=True):
            results[i] = self._usable(sentences[i], value)
            if results[i] is None:
                left.append(i)
            elif self.memory is not None:
                self.memory.put(keys[i], value)
        self._count(self.redis, len(missing) - len(left), len(left))
        return left

    async def close(self) -> None:
        if self.redis is not None:
            await self.redis.close()
