"""Parsed manifests are cached by content, and only so many: a process that writes card after card keeps the most
recently used parsed, not every version it ever read."""

from __future__ import annotations

from cardtool.core.cards import source
from cardtool.core.cards.source import read_source


def test_the_parse_cache_keeps_the_most_recently_used(tmp_path, monkeypatch):
    monkeypatch.setattr(source, "_cache", {})
    monkeypatch.setattr(source, "_CACHE_ENTRIES", 3)
    files = []
    for i in range(4):
        files.append(tmp_path / f"m{i}.yaml")
        files[-1].write_text(f"id: m{i}\n")
    first = read_source(files[0])
    read_source(files[1])
    read_source(files[2])
    assert read_source(files[0]) is first, "a hit: parsed once, and now the most recently used"
    read_source(files[3])
    assert len(source._cache) == 3 and {k[0] for k in source._cache} == {str(files[i]) for i in (0, 2, 3)}
    files[0].write_text("id: changed\n")
    assert read_source(files[0]).data["id"] == "changed", "keyed by content: an edit is a new entry"
