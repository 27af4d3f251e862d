"""Requests by language pair: which served model translates ``source -> target``.

The pairs come from each model's newest version's manifest: ``source_language`` to ``target_language``, for a
multilingual model one pair per code of ``target_languages``, and for a many-to-many one (``source_languages``:
M2M-100, NLLB-200, mBART-50) every pair of two different codes. Codes compare case-insensitively, and a
code the service does not serve falls back to its primary subtag (``en-US`` -> ``en``, ``pt-BR`` -> ``pt``),
so a client may send the regional variants other APIs use. Where several models serve a pair, the operator's
``--pair-models`` choice wins, then the default model, then the first by name.

Front-ends and the engine core share this (no engine here): it reads a :class:`server.versions.VersionIndex`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from common.errors import NmtError
from server.errors import InvalidArgument, NotFound

AUTO = "auto"  # source_language: detect it (server.frontend.detection)


@dataclass(frozen=True)
class PairRoute:
    """The models serving ``source -> target``, and the one a request naming the pair gets."""

    source: str
    target: str
    model: str
    models: tuple[str, ...]
    target_code: dict[str, str]  # model -> the target code as that model names it ("" for its only target)


def language_key(code: str) -> str:
    return code.strip().lower().replace("_", "-")


def primary(code: str) -> str:
    """The primary subtag of a language code (``en-us`` -> ``en``)."""
    return language_key(code).split("-", 1)[0]


def parse_pair_models(setting: str) -> dict[tuple[str, str], str]:
    """``--pair-models``: comma-separated ``source:target=model`` entries."""
    chosen: dict[tuple[str, str], str] = {}
    for entry in filter(None, (e.strip() for e in setting.split(","))):
        pair, equals, model = entry.partition("=")
        source, colon, target = pair.partition(":")
        if not (equals and colon and source.strip() and target.strip() and model.strip()):
            raise NmtError(f"pair_models entry {entry!r} is not source:target=model (e.g. en:de=opus-mt-en-de)")
        chosen[(language_key(source), language_key(target))] = model.strip()
    return chosen


def model_pairs(model: object) -> list[tuple[str, str, str]]:
    """``(source, target, the target code to send the model)`` for each pair a served version translates."""
    manifest = model.manifest
    source = language_key(str(getattr(manifest, "source_language", "") or ""))
    multilingual = list(getattr(manifest, "target_languages", None) or [])
    sources = list(getattr(manifest, "source_languages", None) or [])
    if sources:
        return [(language_key(s), language_key(t), t) for s in sources for t in multilingual if s != t]
    if multilingual:
        return [(source, language_key(code), code) for code in multilingual]
    target = language_key(str(getattr(manifest, "target_language", "") or ""))
    return [(source, target, "")] if source and target else []


class Router:
    """The pair index of a repository's newest versions, rebuilt on every lookup (a handful of models; hot
    reload changes them under it)."""

    def __init__(self, repository: Iterable, *, default_model: Callable[[], str], pair_models: str = "") -> None:
        self.repository = repository
        self.default_model = default_model
        self.chosen = parse_pair_models(pair_models)
        # the last index, its key, and the versions it was built of (held, so that no id in the key is reused)
        self._built: tuple[tuple, dict[tuple[str, str], PairRoute], list[object]] = ((), {}, [])

    def routes(self, allows: Callable[[str], bool] = lambda name: True) -> dict[tuple[str, str], PairRoute]:
        """Every served pair among the models ``allows``, with its models and the one chosen for it (built again
        only when the versions or the default model change: a many-to-many model serves ~40,000 pairs)."""
        newest: dict[str, object] = {}
        for version in self.repository:
            if allows(version.name):
                newest[version.name] = version  # versions come oldest first
        key = (self.default_model(), *((name, id(version)) for name, version in sorted(newest.items())))
        if self._built[0] == key:
            return self._built[1]
        routes = self._index(newest)
        self._built = (key, routes, list(newest.values()))
        return routes

    def _index(self, newest: dict[str, object]) -> dict[tuple[str, str], PairRoute]:
        serving: dict[tuple[str, str], dict[str, str]] = {}
        for name in sorted(newest):
            for source, target, code in model_pairs(newest[name]):
                serving.setdefault((source, target), {})[name] = code
        routes = {}
        for (source, target), codes in serving.items():
            names = tuple(codes)
            preferred = [self.chosen.get((source, target)), self.default_model()]
            model = next((name for name in preferred if name in codes), names[0])
            routes[(source, target)] = PairRoute(source, target, model, names, codes)
        return routes

    def route(self, source: str, target: str, allows: Callable[[str], bool] = lambda name: True) -> PairRoute:
        """The route of ``source -> target`` (``source`` empty: the default model's source if it translates to
        ``target``, else the only source served to it); NOT_FOUND listing the served pairs, INVALID_ARGUMENT
        where an empty source or target is ambiguous."""
        routes = self.routes(allows)
        targets = {target_key for _, target_key in routes}
        target_key = self._served(target, targets) if target else ""
        if source:
            sources = {s for s, t in routes if not target_key or t == target_key}
            source_key = self._served(source, sources)
        else:
            candidates = sorted({s for s, t in routes if t == target_key})
            default = [s for s in candidates if self.default_model() in routes[(s, target_key)].models]
            if default:
                candidates = default[:1]
            if len(candidates) > 1:
                raise InvalidArgument(f"several source languages are translated to {target!r} "
                                      f"({', '.join(candidates)}): name source_language (or {AUTO!r})")
            source_key = candidates[0] if candidates else ""
        if not target_key:
            candidates = sorted({t for s, t in routes if s == source_key})
            if len(candidates) != 1:
                raise InvalidArgument(f"name target_language: {source!r} is translated to "
                                      f"{', '.join(candidates) or 'nothing'}")
            target_key = candidates[0]
        found = routes.get((source_key, target_key))
        if found is None:
            served = ", ".join(f"{s}->{t}" for s, t in sorted(routes)) or "none"
            wanted = f"{source} -> {target}" if source and target else f"from {source}" if source else f"to {target}"
            raise NotFound(f"no model translates {wanted}; served pairs: {served}")
        return found

    def sources_to(self, target: str, allows: Callable[[str], bool] = lambda name: True) -> list[str]:
        """The source languages served to ``target`` (every target when empty): the candidates of detection;
        NOT_FOUND listing the served pairs when there are none."""
        routes = self.routes(allows)
        target_key = self._served(target, {t for _, t in routes}) if target else ""
        sources = sorted({s for s, t in routes if not target_key or t == target_key})
        if not sources:
            served = ", ".join(f"{s}->{t}" for s, t in sorted(routes)) or "none"
            raise NotFound(f"no model translates to {target}; served pairs: {served}")
        return sources

    @staticmethod
    def _served(code: str, served: set[str]) -> str:
        """``code`` as the served set spells it: itself, else its primary subtag, else itself (not served)."""
        key = language_key(code)
        return key if key in served or primary(key) not in served else primary(key)
