"""FID's reference features are kept in the cache, keyed by what decides their bits, and are those bits."""

from __future__ import annotations

import hashlib
import json

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


def test_an_evals_floors_are_kept_and_measured_again_for_another_vae(examples, tmp_path, monkeypatch):
    """The second eval reads the floors (no VAE reconstruction, no features of the training images); a card whose VAE
    weights differ measures them again, and so does another seed."""
    from helpers import write_idx_folder
    from safetensors.numpy import load_file, save_file

    from cardtool.core.evaluation import evaluate as module

    reconstructed = []
    real = module._reconstruct
    monkeypatch.setattr(module, "_reconstruct", lambda *a: reconstructed.append(1) or real(*a))
    options = {"judge": str(examples / "tiny-judge"), "per_class": 2, "steps": [1],
               "data": str(write_idx_folder(tmp_path / "idx"))}
    first = module.evaluate(str(examples / "tiny-base"), **options)
    monkeypatch.setattr(reference, "_memory", {})  # as a new process
    again = module.evaluate(str(examples / "tiny-base"), **options)
    assert len(reconstructed) == 1 and (again.floors, again.kid_floors) == (first.floors, first.kid_floors)
    assert again.manifold_floors == first.manifold_floors and len(first.floors) == 2
    assert len(list((tmp_path / "cache" / "features").glob("*.json"))) == 1
    module.evaluate(str(examples / "tiny-base"), **options, seed=1)
    vae = examples / "tiny-base" / "vae.safetensors"
    tensors = load_file(vae)
    save_file({k: v * 1.01 for k, v in tensors.items()}, vae)
    manifest = examples / "tiny-base" / "card.yaml"
    manifest.write_text(manifest.read_text().replace("2cb79df0a8bfd8bfa3efe7a51e1944d7142b7029e925a4c4bb3c48d0d829abdb",
                                                     hashlib.sha256(vae.read_bytes()).hexdigest()))
    changed = module.evaluate(str(examples / "tiny-base"), **options)
    assert len(reconstructed) == 3 and changed.floors["vae_reconstruction"] != first.floors["vae_reconstruction"]
    assert changed.floors["train_vs_test"] == first.floors["train_vs_test"]


def test_a_cache_limited_to_nothing_keeps_nothing_on_disk(judge, tmp_path, monkeypatch):
    referee, computed = judge
    monkeypatch.setenv("CARDTOOL_CACHE_MAX", "0")
    reference_features(referee, IMAGES, "digest-a")
    assert computed == [40] and not (tmp_path / "cache" / "features").exists()


def test_a_cache_an_earlier_way_of_measuring_filled_is_not_read(judge, monkeypatch):
    referee, computed = judge
    reference_features(referee, IMAGES, "digest-a")
    monkeypatch.setattr(reference, "_memory", {})
    monkeypatch.setattr(reference, "MEASURES", reference.MEASURES + 1)  # a cardtool that measures otherwise
    reference_features(referee, IMAGES, "digest-a")
    assert computed == [40, 40]


def test_the_process_keeps_the_four_latest_references(judge):
    referee, _ = judge
    for n in range(6):
        reference_features(referee, IMAGES[:10 + n], f"digest-{n}")
    assert len(reference._memory) == 4


def test_floors_kept_for_another_key_or_damaged_are_measured_again(judge, tmp_path):
    referee, _ = judge
    measured = []

    def measure():
        measured.append(1)
        return {"floors": {"a": 1.0}}

    def kept():
        return reference.cached_floors(referee, referee.instance, referee.classifier_name, {"seed": 0}, measure,
                                       lambda floors: set(floors) == {"floors"})

    assert kept() == {"floors": {"a": 1.0}} and kept() == {"floors": {"a": 1.0}} and len(measured) == 1
    [file] = (tmp_path / "cache" / "features").glob("*.json")
    for damaged in ({"key": "0" * 64, "floors": {"floors": {"a": 2.0}}}, {"key": file.stem, "floors": {"other": 1}},
                    ["not", "a", "document"]):
        file.write_text(json.dumps(damaged))
        assert kept() == {"floors": {"a": 1.0}}
    assert len(measured) == 4
