"""The text-feature cache (DESIGN.md invariant 6): encoded prompts, in memory and on disk, keyed by every
field that changes them — card, component, that component's weights version and config, the adapter
stack on it, precision, and the prompt. The transformer's weights are not in the key, so retraining the
DiT keeps these entries; a different text encoder misses them. An entry on disk carries a digest of its key and
arrays (`entry_check`): one not written for its key is a miss."""

from __future__ import annotations

import hashlib
import io
import json
import threading
import weakref
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from cardtool.atomic import write_atomic
from cardtool.cache import NoCacheFolder, cache_dir, limit, prune
from cardtool.errors import creating_said

__all__ = ["TextFeatureCache", "cache_dir", "encode_prompts", "filled_prompts", "filled_warning"]


MEMORY_LIMIT = 256 * 2**20  # bytes of entries a process keeps in memory, the least recently used dropped beyond


class TextFeatureCache:
    """(states (L, d), mask (L,) bool) per key — states in float64 at float64 precision, else float32;
    `disk=False` keeps it in memory only. In memory it holds at most `memory_limit` bytes (a process serving many
    distinct prompts would grow without end otherwise); a dropped entry is read back from disk, or encoded again —
    the same bits either way."""

    def __init__(self, root: Path | None = None, *, disk: bool = True, memory_limit: int = MEMORY_LIMIT):
        self.limit = limit() if disk else 0
        self.problem: str | None = None  # why encoded prompts stopped going to disk, said once by the command
        try:
            self.root = (root or cache_dir()) / "text" if disk and self.limit > 0 else None
        except NoCacheFolder as e:
            self.root, self.problem = None, f"{e}; encoded prompts are kept in memory only"
        self._memory: OrderedDict[str, tuple[np.ndarray, np.ndarray]] = OrderedDict()
        self._memory_bytes, self.memory_limit = 0, memory_limit
        self._held = threading.Lock()  # the memory's order and size: LoadedCards in several threads may share one
        self.hits = self.misses = 0
        self._written = 0  # bytes put on disk since the cache was last held to its limit

    @staticmethod
    def key(*, card: str, component: str, weights_version: str, config: dict, adapters: tuple, precision: str,
            prompt: str) -> str:
        fields = {"card": card, "component": component, "weights_version": weights_version, "config": config,
                  "adapters": list(adapters), "precision": precision,
                  "prompt": hashlib.sha256(prompt.encode()).hexdigest(), "encoded": "alone"}
        return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()

    def get(self, key: str):
        with self._held:
            found = self._memory.get(key)
            if found is not None:
                self._memory.move_to_end(key)
        if found is None and self.root is not None:
            path = self.root / key[:2] / f"{key}.npz"
            if _is_file(path):
                try:
                    with np.load(path, allow_pickle=False) as f:  # never unpickle from a cache
                        found, check = (f["states"], f["mask"]), f["check"]
                except Exception:  # noqa: BLE001 - numpy's and zipfile's many errors: any damaged entry is a miss
                    found = None  # (rewritten below), never a failed run
                if found is not None and not (_well_formed(*found) and np.array_equal(check, entry_check(key, *found))):
                    found = None
                if found is not None:
                    self._remember(key, found)
                    _touch(path)  # recently used: the last to be pruned
        if found is None:
            self.misses += 1
        else:
            self.hits += 1
        return found

    def put(self, key: str, states: np.ndarray, mask: np.ndarray, disk: bool = True) -> tuple[np.ndarray, np.ndarray]:
        """Store an entry (on disk too unless `disk` is False) and return it as stored, so a first use sees exactly
        what later hits will."""
        states = np.asarray(states)
        entry = (states.astype(np.float64 if states.dtype == np.float64 else np.float32), np.asarray(mask, dtype=bool))
        self._remember(key, entry)
        if self.root is not None and disk:
            buffer = io.BytesIO()
            np.savez(buffer, states=entry[0], mask=entry[1], check=entry_check(key, *entry))
            try:
                write_atomic(self.root / key[:2] / f"{key}.npz", buffer.getvalue())
            except OSError as e:  # an unwritable cache costs a later process the encoding, never this one its run
                why = creating_said(e, self.root / key[:2]) if e.strerror else e
                self.problem = (f"encoded prompts are not kept on disk: the cache {self.root.parent} cannot be "
                                f"written ({why}); set CARDTOOL_CACHE to a writable folder")
                self.root = None
                return entry
            self._written += buffer.tell()
            if self._written > self.limit // 20:  # a twentieth of the limit new: hold the folder to it again
                self._written = 0
                prune(self.limit, self.root.parent)
        return entry

    def _remember(self, key: str, entry: tuple[np.ndarray, np.ndarray]) -> None:
        with self._held:
            previous = self._memory.pop(key, None)
            self._memory_bytes += _nbytes(entry) - (_nbytes(previous) if previous is not None else 0)
            self._memory[key] = entry
            while self._memory_bytes > self.memory_limit and len(self._memory) > 1:  # never the entry just put
                _, dropped = self._memory.popitem(last=False)
                self._memory_bytes -= _nbytes(dropped)


def _nbytes(entry: tuple[np.ndarray, np.ndarray]) -> int:
    return entry[0].nbytes + entry[1].nbytes


def _is_file(path: Path) -> bool:
    try:
        return path.is_file()
    except OSError:  # a cache folder whose name is too long, or not readable: a miss, never a failed run
        return False


def _touch(path: Path) -> None:
    try:
        path.touch()
    except OSError:  # a read-only cache still serves hits
        pass


def _well_formed(states: np.ndarray, mask: np.ndarray) -> bool:
    """Whether a cache file's arrays can be an entry: states (L, d) floating and finite, mask (L,) boolean."""
    return states.ndim == 2 and mask.ndim == 1 and len(states) == len(mask) and mask.dtype == bool \
        and states.dtype in (np.float32, np.float64) and bool(np.isfinite(states).all())


def entry_check(key: str, *arrays: np.ndarray) -> np.ndarray:
    """sha256 of a cache entry's key and arrays, stored beside them: arrays not written for this key — a file damaged
    in a way the zip format does not see, or replaced — are a miss, even when their shape would pass (text states
    of another width reach the DiT's projection and fail the run there). FID's reference features use it too."""
    digest = hashlib.sha256(key.encode())
    for array in arrays:
        digest.update(f"{array.dtype.str}{array.shape}".encode())
        digest.update(np.ascontiguousarray(array).tobytes())
    return np.frombuffer(digest.digest(), dtype=np.uint8)


def encode_prompts(instance, prompts: list[str], cache: TextFeatureCache, component: str = "text_encoder"):
    """Features for each prompt, from the cache or encoded; the encoder is built only on a miss. A prompt's features
    are its features encoded alone: beside other prompts an encoder's products may round differently (~2e-6 on some
    CPUs), which would make an image's bits depend on what the cache held when it was made. Many missing prompts go
    in fixed groups where a trial shows those give the same bits (`_encoded`)."""
    spec = instance.card.manifest.components[component]
    common = dict(card=instance.card.id, component=component, weights_version=instance.weights_version(component),
                  config=spec.config, adapters=(), precision=instance.precision)
    keys = [cache.key(**common, prompt=p) for p in prompts]
    found = {k: cache.get(k) for k in dict.fromkeys(keys)}
    missing = [k for k, v in found.items() if v is None]
    if missing:
        first = {k: p for k, p in zip(keys, prompts, strict=True) if k in missing}
        from cardtool.backends.registry import NoCellAvailable
        from cardtool.errors import BadInput

        try:
            encoder, arrays = instance.component(component), instance.arrays
        except NoCellAvailable:  # no encoder of its own on this platform (numpy's is BERT's only): it reads the cache
            shown = ", ".join(repr(first[k][:60]) for k in missing[:3]) + (" …" if len(missing) > 3 else "")
            device = instance.platform.device
            # with CARDTOOL_CACHE_MAX=0 the CPU's run keeps nothing for this one to read: the advice alone would loop
            kept = "" if cache.root is not None or limit() else "unset CARDTOOL_CACHE_MAX=0, which keeps none on disk; "
            raise BadInput(f"the {device} platform runs no text encoder of this kind and reads encoded prompts from "
                           f"the cache, which holds none of {shown}; {kept}run the same command once with --device cpu "
                           f"to encode them (at {instance.precision}), then again on {device}") from None
        # the numpy reference's encodings stay in this process: the key holds no platform, and a torch run reading
        # them from disk would make bits that depend on which platform encoded a prompt first
        shared = instance.platform.device != "numpy"
        for k, (states, mask) in zip(missing, _encoded(encoder, arrays, [first[k] for k in missing]), strict=True):
            found[k] = cache.put(k, states, mask, disk=shared)
    return [found[k] for k in keys]


TEXT_GROUP = 16  # prompts an encoder call takes when grouping gives each the bits it gets alone
GROUPED_FROM = 4 * TEXT_GROUP  # missing prompts worth the trial: fewer are encoded alone
# the trial's verdict per encoder (built once per process and card component): whether groups give alone's bits
_exact: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _encoded(encoder, arrays, prompts: list[str]) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Each prompt's (states, mask) as `encoder` gives it alone, as numpy arrays. One by one, each prompt costs an
    encoder call's whole overhead: with many prompts missing (a prompts file of hundreds) the text encoder took nearly
    half a generation's time. So those go in groups of exactly TEXT_GROUP where a trial on this encoder shows a group
    gives every row the bits it gets alone — the first prompts and two probes (the empty prompt, and one that fills
    every token, whose attention needs no mask alone but gets one in a group), alone and as one group. Each group
    holds at least one empty prompt, so it always takes the path the trial compared. Where the trial finds a
    difference (another BLAS, a GPU), each prompt is encoded alone: the bits never depend on the verdict, only the
    time does."""
    def alone(prompt: str) -> tuple[np.ndarray, np.ndarray]:
        return _group(encoder, arrays, [prompt])[0]

    if len(prompts) < GROUPED_FROM:
        yield from map(alone, prompts)
        return
    rows = TEXT_GROUP - 1  # prompts a group carries beside its empty prompt
    exact = _verdict(encoder)
    if exact is None:
        tried, prompts = prompts[:rows - 1], prompts[rows - 1:]
        singles = [alone(p) for p in tried]
        yield from singles
        exact = _trial(encoder, arrays, tried, singles)
        _remember(encoder, exact)
    if not exact:
        yield from map(alone, prompts)
        return
    for start in range(0, len(prompts), rows):
        chunk = prompts[start:start + rows]
        yield from _group(encoder, arrays, chunk + [""] * (TEXT_GROUP - len(chunk)))[:len(chunk)]


def _trial(encoder, arrays, tried: list[str], singles: list[tuple]) -> bool:
    """Whether one group of `tried` and the probes gives each row the bits it got alone (`singles` for `tried`)."""
    probes = ["", "x " * 4096]  # tokenizers truncate the long one at max_length
    try:
        expected = singles + [_group(encoder, arrays, [probe])[0] for probe in probes]
        grouped = _group(encoder, arrays, tried + probes)
    except Exception:  # noqa: BLE001 - an encoder that refuses a probe (a plugin's, too long for it) is not grouped:
        return False   # the user's prompts were encoded alone, and go on so
    return all(np.array_equal(a, b) for one, other in zip(expected, grouped, strict=True)
               for a, b in zip(one, other, strict=True))


def _group(encoder, arrays, prompts: list[str]) -> list[tuple[np.ndarray, np.ndarray]]:
    states, mask = encoder(prompts)
    return list(zip(arrays.to_numpy(states), arrays.to_numpy(mask), strict=True))


def _verdict(encoder) -> bool | None:
    try:
        return _exact.get(encoder)
    except TypeError:  # an encoder that cannot be weakly referenced: tried on each call
        return None


def _remember(encoder, exact: bool) -> None:
    try:
        _exact[encoder] = exact
    except TypeError:
        pass


def filled_prompts(instance, prompts: list[str], cache: TextFeatureCache, component: str = "text_encoder",
                   what: str = "prompt", on_encoded=None) -> str | None:
    """A warning naming the prompts whose tokens fill every position the text encoder reads (its max_length): words
    past them are cut without a word otherwise, as diffusers' pipelines warn. Read from the encoded mask, so a prompt
    served from the cache is judged as one encoded now (the features stay in the cache for the sampler). A prompt that
    fits exactly is named too: the mask cannot tell it apart, and what the warning says holds of it as well.
    `on_encoded(done, distinct)` after each chunk: 20,000 new prompts took the built-in encoder 73 s on two cores,
    before the first image."""
    distinct = list(dict.fromkeys(prompts))
    filled, length = [], 0
    for start in range(0, len(distinct), 256):  # as the workflow's preflight: the cache keeps what a chunk encodes
        chunk = distinct[start:start + 256]
        for prompt, (_, mask) in zip(chunk, encode_prompts(instance, chunk, cache, component), strict=True):
            if len(mask) and bool(np.asarray(mask).all()):
                filled.append(prompt)
                length = len(mask)
        if on_encoded is not None:
            on_encoded(start + len(chunk), len(distinct))
    return filled_warning(filled, length, what)


def filled_warning(filled: list[str], length: int, what: str = "prompt") -> str | None:
    """What `filled_prompts` says of the prompts (or captions) `filled` whose tokens filled all `length` positions."""
    if not filled:
        return None
    shown = ", ".join(repr(p if len(p) <= 60 else p[:59] + "…") for p in filled[:3])
    more = f" and {len(filled) - 3} more" if len(filled) > 3 else ""
    which = f"a {what} fills" if len(filled) == 1 else f"{len(filled):,} {what}s fill"
    return (f"{which} all {length} tokens the text encoder reads (its max_length): words past them do not reach the "
            f"model — {shown}{more}; shorten {'it' if len(filled) == 1 else 'them'}")
