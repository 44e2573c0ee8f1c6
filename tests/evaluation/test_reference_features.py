"""FID's reference features are kept in the cache, keyed by what decides their bits, and are those bits."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cardtool.backends.platform import Platform
from cardtool.core.cards.loader import load_card
from cardtool.core.evaluation import reference
from cardtool.core.evaluation.reference import reference_features
from cardtool.core.evaluation.reward import FashionJudge
from cardtool.core.sampling.instance import ModelInstance


@pytest.fixture
def judge(examples, tmp_path, monkeypatch):
    referee = FashionJudge(ModelInstance(load_card(examples / "tiny-judge"), Platform("cpu", "generic"), "float32"))
    computed = []
    features = referee.features
    monkeypatch.setattr(referee, "features", lambda images: computed.append(len(images)) or features(images))
    return referee, computed


IMAGES = np.random.default_rng(0).integers(0, 256, (40, 28, 28), dtype=np.uint8)


def test_a_second_process_reads_the_features_the_first_computed(judge, tmp_path, monkeypatch):
    referee, computed = judge
    first = reference_features(referee, IMAGES, "digest-a")
    assert computed == [40] and len(list((tmp_path / "cache" / "features").glob("*.npz"))) == 1
    monkeypatch.setattr(reference, "_memory", {})
    again = reference_features(referee, IMAGES, "digest-a")
    assert computed == [40] and again.dtype == np.float32 and np.array_equal(again, first)
    assert not first.flags.writeable and not again.flags.writeable, "shared: no eval may change another's reference"
    assert np.array_equal(first, FashionJudge.features(referee, IMAGES)), "the bits computing them now gives"


def test_other_images_threads_or_a_damaged_file_are_computed_again(judge, tmp_path, monkeypatch):
    referee, computed = judge
    reference_features(referee, IMAGES, "digest-a")
    reference_features(referee, IMAGES[:30], "digest-b")
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads + 1)  # oneDNN may split the work otherwise: kept apart
        reference_features(referee, IMAGES, "digest-a")
    finally:
        torch.set_num_threads(threads)
    assert computed == [40, 30, 40]
    monkeypatch.setattr(reference, "_memory", {})
    kept = tmp_path / "cache" / "features" / f"{reference._key(referee, IMAGES, 'digest-a')}.npz"
    with np.load(kept) as f:
        features, check = f["features"].copy(), f["check"]
    features[0, 0] += 1.0  # a file not written for its key, or changed since: a miss
    np.savez(kept, features=features, check=check)
    computed.clear()
    assert np.array_equal(reference_features(referee, IMAGES, "digest-a"), FashionJudge.features(referee, IMAGES))
    assert computed == [40]


def test_without_a_cache_folder_the_features_are_kept_in_memory(judge, monkeypatch):
    referee, computed = judge
    monkeypatch.delenv("CARDTOOL_CACHE")
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.delenv("HOME", raising=False)
    monkeypatch.setattr("pwd.getpwuid", lambda uid: (_ for _ in ()).throw(KeyError(uid)))
    first = reference_features(referee, IMAGES, "digest-a")
    assert np.array_equal(reference_features(referee, IMAGES, "digest-a"), first) and computed == [40]
