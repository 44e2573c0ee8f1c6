"""FID's reference — the judge's features of the real test images — and the eval's floors, kept in cardtool's cache
(`features/`).

The 10,000 Fashion-MNIST test images through the judge took 3 s of every eval on an idle 2-core CPU (13 s with the
cores shared), an eighth of a default eval's time, and a training run's `--watch-every` paid it again. An entry is
keyed by everything that decides its bits — the judge's weights version and config, the images' digest, the platform,
torch's version and its thread count — so a kept entry is what computing it now would give; it carries a sha256 of its
key and array, so a damaged or replaced file is a miss, computed again. The floors (the training images' and their VAE
reconstructions' distances to the reference) cost ~8 s more — the reconstructions, their features and two KID
estimates over 100 subsets — and are kept the same way, keyed also by the VAE, the data and the images drawn."""

from __future__ import annotations

import hashlib
import io
import json
import threading
from collections.abc import Callable

import numpy as np

from cardtool.atomic import write_atomic
from cardtool.core.sampling.text_cache import entry_check

__all__ = ["cached_floors", "reference_features"]

# in every key: raise it when what is kept would be computed otherwise (the judge's features, FID, KID, the floors'
# images), so that a cache filled by an earlier cardtool is not read as this one's
MEASURES = 1
_memory: dict[str, np.ndarray] = {}  # this process's, by key: a flywheel evaluates three cards against one reference
_held = threading.Lock()


def reference_features(referee, images: np.ndarray, digest: str) -> np.ndarray:
    """`referee.features(images)` (a FashionJudge's) for the images whose content `digest` names, from the cache when
    it holds them."""
    key = _key(referee, images, digest)
    with _held:
        found = _memory.get(key)
    if found is None:
        found = _read(key)
    if found is None:
        found = referee.features(images)
        _write(key, found)
    found.setflags(write=False)  # shared by every eval of this process that asks: none may change it for the others
    with _held:
        if len(_memory) >= 4 and key not in _memory:
            _memory.pop(next(iter(_memory)))
        _memory[key] = found
    return found


def cached_floors(referee, vae_instance, vae_name: str, fields: dict, compute: Callable[[], dict],
                valid: Callable[[dict], bool]) -> dict:
    """The floors `compute()` measures with `referee` and the VAE `vae_name` of `vae_instance` on what `fields` names
    (the data's digests, the seed, the count), from the cache when it holds a `valid` document for them."""
    spec = vae_instance.card.manifest.components[vae_name]
    key = _key(referee, None, "", vae={"weights_version": vae_instance.weights_version(vae_name), "impl": spec.impl,
                                       "config": spec.config, "precision": vae_instance.precision}, **fields)
    folder = _folder()
    if folder is not None:
        try:
            kept = json.loads((folder / f"{key}.json").read_text())
            if isinstance(kept, dict) and kept.get("key") == key and valid(kept.get("floors", {})):
                return kept["floors"]
        except (OSError, ValueError):  # not there, unreadable, not JSON: measured
            pass
    floors = json.loads(json.dumps(compute()))  # as read back: pairs are lists either way
    if folder is not None:
        try:
            write_atomic(folder / f"{key}.json", json.dumps({"key": key, "floors": floors}).encode())
        except OSError:
            pass
    return floors


def _key(referee, images: np.ndarray | None, digest: str, **more) -> str:
    import torch

    instance, name = referee.instance, referee.classifier_name
    spec, platform = instance.card.manifest.components[name], instance.platform
    fields = {"weights_version": instance.weights_version(name), "impl": spec.impl, "config": spec.config,
              "images": [digest, None if images is None else list(images.shape)],
              "platform": f"{platform.device}/{platform.arch}", "torch": torch.__version__,
              "threads": torch.get_num_threads(), "measures": MEASURES, **more}
    return hashlib.sha256(json.dumps(fields, sort_keys=True, default=str).encode()).hexdigest()


def _folder():
    """The cache's `features/`, or None where nothing is kept on disk: no cache folder, or CARDTOOL_CACHE_MAX=0."""
    from cardtool.cache import NoCacheFolder, cache_dir, limit

    try:
        return cache_dir() / "features" if limit() else None
    except NoCacheFolder:  # memory only, as the text cache
        return None


def _read(key: str) -> np.ndarray | None:
    folder = _folder()
    if folder is None:
        return None
    try:
        with np.load(folder / f"{key}.npz", allow_pickle=False) as f:  # never unpickle from a cache
            features, check = f["features"], f["check"]
    except Exception:  # noqa: BLE001 - not there, unreadable or damaged in any of numpy's and zipfile's ways: a miss
        return None
    if features.dtype != np.float32 or features.ndim != 2 or not np.array_equal(check, entry_check(key, features)):
        return None
    return features


def _write(key: str, features: np.ndarray) -> None:
    folder = _folder()
    if folder is None:
        return
    buffer = io.BytesIO()
    np.savez(buffer, features=features, check=entry_check(key, features))
    try:
        write_atomic(folder / f"{key}.npz", buffer.getvalue())
    except OSError:  # an unwritable cache costs the next eval these seconds, never this one its run
        pass
