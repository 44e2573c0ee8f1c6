"""The text-feature cache: keyed per DESIGN invariant 6, on disk atomically, never re-encoding a prompt."""

from __future__ import annotations

import re

import numpy as np
from helpers import race, write_tensors
from safetensors.numpy import load_file

from cardtool.backends.platform import Platform
from cardtool.core.cards.loader import load_card
from cardtool.core.sampling.instance import ModelInstance
from cardtool.core.sampling.text_cache import TextFeatureCache, cache_dir, encode_prompts, filled_prompts

CPU = Platform("cpu", "generic")


def encode(folder, prompts, cache):
    instance = ModelInstance(load_card(folder), CPU)
    return instance, encode_prompts(instance, prompts, cache)


def test_a_repeated_prompt_neither_re_encodes_nor_loads_the_encoder(examples, tmp_path):
    first_instance, first = encode(examples / "tiny-base", ["a bag", "a coat"], TextFeatureCache(tmp_path / "c"))
    assert first_instance.is_awake("text_encoder")
    cache = TextFeatureCache(tmp_path / "c")  # a new process: only the disk entries remain
    instance, again = encode(examples / "tiny-base", ["a coat", "a bag"], cache)
    assert not instance.is_awake("text_encoder") and (cache.hits, cache.misses) == (2, 0)
    assert np.array_equal(again[0][0], first[1][0]) and np.array_equal(again[1][1], first[0][1])


def test_new_transformer_weights_keep_the_text_entries(examples, tmp_path):
    encode(examples / "tiny-base", ["a bag"], TextFeatureCache(tmp_path / "c"))
    manifest = examples / "tiny-base" / "card.yaml"
    shapes = {k: v.shape for k, v in load_file(str(examples / "tiny-base" / "transformer.safetensors")).items()}
    digest = write_tensors(examples / "tiny-base" / "transformer.safetensors", shapes, seed=9)
    text = manifest.read_text()
    old = re.search(r"weights: transformer.safetensors\n    sha256: (\w+)", text).group(1)
    manifest.write_text(text.replace(old, digest))
    cache = TextFeatureCache(tmp_path / "c")
    instance, _ = encode(examples / "tiny-base", ["a bag"], cache)
    assert (cache.hits, cache.misses) == (1, 0) and not instance.is_awake("text_encoder")


def test_a_different_text_encoder_misses(examples, tmp_path):
    encode(examples / "tiny-base", ["a bag"], TextFeatureCache(tmp_path / "c"))
    manifest = examples / "tiny-base" / "card.yaml"
    manifest.write_text(manifest.read_text().replace("config: {max_length: 16}", "config: {max_length: 12}"))
    cache = TextFeatureCache(tmp_path / "c")
    _, [(states, mask)] = encode(examples / "tiny-base", ["a bag"], cache)
    assert (cache.hits, cache.misses) == (0, 1) and states.shape == (12, 384)


def test_every_key_field_changes_the_key():
    base = dict(card="c", component="text_encoder", weights_version="v1", config={"max_length": 16}, adapters=(),
                precision="float32", prompt="a bag")
    key = TextFeatureCache.key(**base)
    for field, other in [("card", "d"), ("component", "te2"), ("weights_version", "v2"), ("config", {}),
                         ("adapters", (("style", "v1", 1.0),)), ("precision", "bfloat16"), ("prompt", "a bag ")]:
        assert TextFeatureCache.key(**{**base, field: other}) != key, field


def test_entries_are_atomic_npz_files_and_a_damaged_one_is_rewritten(tmp_path):
    cache = TextFeatureCache(tmp_path / "c")
    cache.put("ab" + "0" * 62, np.ones((4, 3)), np.array([1, 1, 0, 0]))
    [path] = list((tmp_path / "c" / "text").rglob("*.npz"))
    assert not list(path.parent.glob(".*tmp")), "no temporary files remain"
    whole = path.read_bytes()
    for damage in (b"garbage", whole[: len(whole) // 2], whole[:-30], b""):  # a truncated zip is no OSError
        path.write_bytes(damage)
        fresh = TextFeatureCache(tmp_path / "c")
        assert fresh.get("ab" + "0" * 62) is None and fresh.misses == 1


def test_cache_dir_honours_cardtool_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("CARDTOOL_CACHE", str(tmp_path / "x"))
    assert cache_dir() == tmp_path / "x"
    monkeypatch.delenv("CARDTOOL_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "xdg" / "cardtool"
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/dir")  # the XDG spec: ignored, not a cache in every working folder
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_dir() == tmp_path / "home" / ".cache" / "cardtool"


def test_the_disk_cache_is_held_to_its_limit_dropping_the_least_recently_used(examples, tmp_path, monkeypatch):
    """CARDTOOL_CACHE_MAX bounds the encoded prompts on disk: a run that writes past it removes the entries used
    longest ago (a hit counts as a use), never the one it just wrote; 0 keeps none on disk."""
    import os

    root = tmp_path / "c"
    encode(examples / "tiny-base", ["a bag", "a coat", "a shirt"], TextFeatureCache(root))
    files = sorted((root / "text").glob("*/*.npz"))
    for age, path in enumerate(files):  # make the order of last use explicit: older mtime, used longer ago
        os.utime(path, (1e9 + age, 1e9 + age))
    oldest = files[0]
    encode(examples / "tiny-base", ["a bag", "a coat", "a shirt"], TextFeatureCache(root))  # hits touch all three
    os.utime(files[1], (1e9 + 0.5, 1e9 + 0.5))  # ...then one of them is the least recently used
    entry = files[0].stat().st_size
    monkeypatch.setenv("CARDTOOL_CACHE_MAX", str(int(6.5 * entry)))  # room for six of the seven entries
    encode(examples / "tiny-base", [f"a sock {i}" for i in range(4)], TextFeatureCache(root))
    left = set((root / "text").glob("*/*.npz"))
    assert oldest in left and files[1] not in left, "the least recently used went first, not the oldest written"
    assert len(left) == 6 and sum(p.stat().st_size for p in left) <= 6.5 * entry
    monkeypatch.setenv("CARDTOOL_CACHE_MAX", "0")
    cache = TextFeatureCache(tmp_path / "none")
    encode(examples / "tiny-base", ["a bag"], cache)
    assert cache.misses == 1 and not (tmp_path / "none").exists()


def test_memory_holds_at_most_its_limit_and_a_dropped_entry_comes_back_the_same(examples, tmp_path):
    """A process serving many distinct prompts keeps the most recently used within memory_limit; a dropped entry is
    read back from disk (or encoded again without one) with the same bits."""
    entry = 16 * 384 * 4 + 16  # one prompt's float32 states at max_length 16 and its mask
    for disk in (True, False):
        cache = TextFeatureCache(tmp_path / "c", disk=disk, memory_limit=3 * entry)
        _, first = encode(examples / "tiny-base", ["a bag", "a coat", "a shirt", "a dress"], cache)
        assert len(cache._memory) == 3 and cache._memory_bytes == 3 * entry, "the first prompt was dropped"
        encode(examples / "tiny-base", ["a coat"], cache)  # a hit: now the most recently used
        encode(examples / "tiny-base", ["a sock"], cache)
        assert "a coat" in _prompts(cache, examples) and "a shirt" not in _prompts(cache, examples)
        misses = cache.misses
        _, [again] = encode(examples / "tiny-base", ["a bag"], cache)
        assert np.array_equal(again[0], first[0][0]) and np.array_equal(again[1], first[0][1])
        assert cache.misses == misses + (0 if disk else 1), "read back from disk; without one, encoded again"
    assert TextFeatureCache(disk=False).memory_limit == 256 * 2**20, "the default: ~10,900 prompts of fashion-base's"


def test_threads_sharing_a_cache_keep_its_memory_whole():
    """LoadedCards in several threads may share one cache: a get moved an entry another thread had just dropped
    (KeyError), and the memory's byte count drifted from what it held."""
    cache = TextFeatureCache(disk=False, memory_limit=10 * (8 * 64 * 4 + 8))
    entry = (np.ones((8, 64), np.float32), np.ones(8, bool))

    def serve(seed):
        for key in np.random.default_rng(seed).integers(0, 40, size=20000).astype(str):
            if cache.get(key) is None:
                cache.put(key, *entry)

    assert race(serve) == []
    assert cache._memory_bytes == sum(s.nbytes + m.nbytes for s, m in cache._memory.values()) <= cache.memory_limit


def _prompts(cache, examples) -> set[str]:
    """The prompts whose entries the cache holds in memory (keys are hashes: match them against candidates)."""
    instance = ModelInstance(load_card(examples / "tiny-base"), CPU)
    spec = instance.card.manifest.components["text_encoder"]
    common = dict(card=instance.card.id, component="text_encoder", weights_version=instance.weights_version(
        "text_encoder"), config=spec.config, adapters=(), precision=instance.precision)
    return {p for p in ("a bag", "a coat", "a shirt", "a dress", "a sock")
            if TextFeatureCache.key(**common, prompt=p) in cache._memory}


def test_a_prompt_filling_every_token_the_encoder_reads_is_named_also_from_the_cache(examples, tmp_path):
    """tiny-base reads 16 tokens, two of them [CLS] and [SEP]: 14 one-token words fill it, 13 do not."""
    fits, fills = " ".join("abcdefghijklm"), " ".join("abcdefghijklmn")
    long = "a dark grey pullover with long sleeves and a round neck on a white background"
    instance = ModelInstance(load_card(examples / "tiny-base"), CPU)
    assert filled_prompts(instance, [fits, "a bag", ""], TextFeatureCache(tmp_path / "c")) is None
    warning = filled_prompts(instance, [fills, long, fills], TextFeatureCache(tmp_path / "c"))
    assert warning == (f"2 prompts fill all 16 tokens the text encoder reads (its max_length): words past them do not "
                       f"reach the model — {fills!r}, {long[:59] + '…'!r}; shorten them")
    cache = TextFeatureCache(tmp_path / "c")  # a later process: the prompts come from the disk, and are named alike
    again = ModelInstance(load_card(examples / "tiny-base"), CPU)
    assert filled_prompts(again, [long], cache).startswith("a prompt fills all 16 tokens")
    assert (cache.hits, cache.misses) == (1, 0) and not again.is_awake("text_encoder")
