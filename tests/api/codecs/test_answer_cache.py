"""The cache of whole SelectBackend answers: its byte budget and its generations."""

from __future__ import annotations

from service.api.codecs.answer_cache import MAX_KEY_BYTES, AnswerCache, CachedAnswer


def test_the_cache_keeps_its_byte_budget_least_recently_used_first() -> None:
    cache = AnswerCache(max_bytes=100)

    def entry(size: int) -> CachedAnswer:
        return CachedAnswer(0, b"p" * size, ())

    cache.put(b"a" * 10, entry(30))
    cache.put(b"b" * 10, entry(30))
    assert cache.get(b"a" * 10, 0) is not None  # a is now the most recent
    cache.put(b"c" * 10, entry(30))  # 120 bytes: b goes
    assert cache.size == 80
    assert cache.get(b"b" * 10, 0) is None
    assert cache.get(b"a" * 10, 0) is not None
    assert cache.get(b"a" * 10, 1) is None  # another generation
    cache.put(b"d" * 10, entry(200))  # larger than the whole budget: not kept
    cache.put(b"e" * (MAX_KEY_BYTES + 1), entry(1))
    assert len(cache) == 2
    cache.put(b"a" * 10, entry(10))  # replaces, the size follows
    assert cache.size == 60
