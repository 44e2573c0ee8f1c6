"""Rewards are cards. A reward serves `score(images, prompts)` — one number per decoded image, batched on the
platform — from a component of a kind in `REWARD_KINDS`; `load_reward` refuses a card that serves none. The one
kind today is the Fashion-MNIST judge of the `fashion-classifier` card: the classifier's probability of the
prompt's class (it also gives penultimate-layer features for FID).

A prompt's class: a class name or synonym found in it, or its plural (the longest wins; of two as long, the later —
English puts a compound's head last: a dress shirt is a shirt), else the class of the training phrasing
(`training_prompts`: names and synonyms in templates) the text encoder embeds closest (cosine of mean-pooled token
states). So read, 53 of the 60 phrasings the family never trained on in `benchmarks/free_text.py` get the class they
name, against 44 by the canonical prompts alone with neither plurals nor a compound's head: what `rl --prompts` and
best-of-N reward on free text."""

from __future__ import annotations

import re
from typing import Protocol

import numpy as np

from cardtool.backends.precision import full_float32
from cardtool.core.data import CLASS_NAMES, IMAGE_SIZE, unit_images
from cardtool.core.prompts import SYNONYMS, training_prompts
from cardtool.core.sampling.instance import ModelInstance
from cardtool.errors import BadInput

__all__ = ["FashionJudge", "Reward", "REWARD_KINDS", "cannot_score", "free_text_reading", "image_size", "load_reward",
           "named_class", "not_a_reward", "reward_card"]


class Reward(Protocol):
    """What reward fine-tuning and best-of-N ask of a reward card."""

    card_id: str

    def score(self, images: np.ndarray, prompts: list[str]) -> np.ndarray:
        """Rewards (B,) of uint8 images (B, H, W) made for `prompts`; higher is better."""


JUDGED_SIZE = IMAGE_SIZE  # the fashion CNN's input: 28×28 grey images

# Images the judge classifies per call: at 1,000 the fashion CNN's first activations are 100 MB, which glibc maps fresh
# and hands back on every call (3 million page faults for the 10,000 test images FID compares with); at 128, 13 MB.
# The same features, bit for bit, in 2.7 instead of 7.7 s on the 2-core Zen 5 EPYC.
JUDGE_BATCH = 128

_WORDS = [(len(w), re.compile(rf"\b{re.escape(w.lower())}(?:e?s)?\b"), label)
          for label, name in enumerate(CLASS_NAMES) for w in (name, *SYNONYMS[name])]


def named_class(prompt: str) -> int | None:
    """The class whose name or synonym (or its plural) the prompt holds: the longest such word, of two as long the
    one that ends later ("a dress shirt" is a shirt, "a shirt dress" a dress); None if it names none."""
    text = prompt.lower()
    found = [(size, match.end(), label) for size, pattern, label in _WORDS for match in pattern.finditer(text)]
    return max(found)[2] if found else None


class FashionJudge:
    def __init__(self, instance: ModelInstance):
        components = instance.card.manifest.components
        self.classifier_name = next((n for n, c in components.items() if c.kind == "classifier"), None)
        if self.classifier_name is None:
            raise BadInput(f"card '{instance.card.id}' has no classifier component to judge with")
        self.instance, self.card_id = instance, instance.card.id
        self._phrasings = None  # the training phrasings' embeddings and classes, made on the first free-text prompt
        self._model()  # built now: a platform that cannot run it says so before any sampling, not after

    def _model(self):
        return self.instance.component(self.classifier_name)

    def _batches(self, images: np.ndarray, fn, size: int = JUDGE_BATCH) -> tuple[np.ndarray, ...]:
        """Run fn over uint8 images (B, 28, 28) in batches, in the classifier's input as its training made it
        (data.unit_images); returns each of the arrays it gives, stacked, in numpy. On the numpy platform the
        classifier is its numpy forward, in float32 as on every device."""
        model, out = self._model(), []
        starts = range(0, max(len(images), 1), size)  # no images: one empty batch, for the result's shape
        if self.instance.platform.device == "numpy":
            for i in starts:
                out.append([np.asarray(a, dtype=np.float32) for a in fn(model, unit_images(images[i:i + size]))])
        else:
            import torch

            device = next(model.parameters()).device
            with torch.no_grad(), full_float32(self.instance.platform):  # a measure: the same float32 on every device
                for i in starts:
                    x = torch.from_numpy(unit_images(images[i:i + size])).to(device)
                    out.append([t.float().cpu().numpy() for t in fn(model, x)])
        return tuple(np.concatenate(parts) for parts in zip(*out, strict=True))

    def probabilities(self, images: np.ndarray) -> np.ndarray:
        """Class probabilities (B, 10) of uint8 images (B, 28, 28)."""
        return self._batches(images, lambda m, x: (_softmax(m(x)),))[0]

    def features(self, images: np.ndarray) -> np.ndarray:
        """Penultimate-layer features (B, 256): the space FID-FMNIST is measured in."""
        return self._batches(images, lambda m, x: (m.embed(x),))[0]

    def judged(self, images: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """`features(images)` and `probabilities(images)` from one pass of the classifier's layers below its head: the
        same numbers, at about half the work of the two calls."""
        def both(model, x):
            features = model.embed(x)
            return features, _softmax(model.head(features))

        return self._batches(images, both)

    def prompt_classes(self, prompts: list[str]) -> np.ndarray:
        labels, unmatched = [], []
        for i, prompt in enumerate(prompts):
            match = named_class(prompt)
            labels.append(match)
            if match is None:
                unmatched.append(i)
        if unmatched:
            nearest = self._nearest([prompts[i] for i in unmatched])
            for i, label in zip(unmatched, nearest, strict=True):
                labels[i] = int(label)
        return np.array(labels, dtype=np.int64)

    def _nearest(self, prompts: list[str]) -> np.ndarray:
        if "text_encoder" not in self.instance.card.manifest.components:
            unique = list(dict.fromkeys(prompts))
            shown = ", ".join(repr(p[:60]) for p in unique[:3]) + (" …" if len(unique) > 3 else "")
            raise BadInput(f"reward card '{self.instance.card.id}' cannot tell which class {shown} asks for: the "
                           f"prompt names none ({', '.join(CLASS_NAMES)}) and the card has no text encoder to find "
                           "the nearest; name the garment in the prompt, or use a reward card with a text encoder")
        if self._phrasings is None:
            groups = training_prompts()
            self._phrasings = (self._embed([p for group in groups for p in group]),
                               np.repeat(np.arange(len(groups)), [len(group) for group in groups]))
        embedded, classes = self._phrasings
        similarity = self._embed(prompts) @ embedded.T
        return np.stack([similarity[:, classes == c].max(1) for c in range(len(CLASS_NAMES))], 1).argmax(1)

    def _embed(self, prompts: list[str]) -> np.ndarray:
        encoder = self.instance.component("text_encoder")
        states, mask = encoder(prompts)
        states, mask = self.instance.arrays.to_numpy(states), self.instance.arrays.to_numpy(mask)
        pooled = (states * mask[..., None]).sum(1) / mask.sum(1, keepdims=True)
        return pooled / np.linalg.norm(pooled, axis=1, keepdims=True)

    def score(self, images: np.ndarray, prompts: list[str]) -> np.ndarray:
        """Reward per image: the probability the classifier gives the class its prompt asks for."""
        if len(images) != len(prompts):
            raise BadInput(f"score: {len(images)} images but {len(prompts)} prompts")
        labels = self.prompt_classes(prompts)
        return self.probabilities(images)[np.arange(len(labels)), labels]


def free_text_reading(reward, prompts: list[str], shown: int = 6) -> str | None:
    """What the reward scores prompts that name no class word as — the class of the nearest phrasing it knows, which
    may not be the garment meant ("a camisole" reads as a coat) — said before a run trains on them or best-of-N
    selects by them; None where every prompt names its class (or the reward reads no prompts)."""
    if not isinstance(reward, FashionJudge):
        return None
    unnamed = [p for p in dict.fromkeys(prompts) if named_class(p) is None]
    if not unnamed:
        return None
    read = reward.prompt_classes(unnamed)
    listed = ", ".join(f"{p[:40]!r} as {CLASS_NAMES[int(c)]}" for p, c in zip(unnamed[:shown], read, strict=False))
    more = f", and {len(unnamed) - shown} more" if len(unnamed) > shown else ""
    return (f"{len(unnamed)} prompt(s) name no garment, and reward '{reward.card_id}' reads them by the nearest "
            f"phrasing it knows: {listed}{more}; name the garment where that is not the one meant")


def _softmax(logits):
    """Over the classes, of a torch tensor or of the numpy forward's array."""
    if not isinstance(logits, np.ndarray):
        return logits.softmax(-1)
    exp = np.exp(logits - logits.max(-1, keepdims=True))
    return exp / exp.sum(-1, keepdims=True)


REWARD_KINDS = {"classifier": FashionJudge}  # component kind → the reward served from it


def load_reward(ref: str, platform=None, scores=None) -> Reward:
    """The reward card `ref` (an id, folder or manifest) on `platform`, in float32; a clear error for a card that
    serves no reward, or whose images are not those of the card it `scores` (`reward_card`)."""
    card, kind = reward_card(ref, scores)
    return REWARD_KINDS[kind](ModelInstance(card, platform, "float32"))


def reward_card(ref: str, scores=None):
    """The card `ref` and the kind of the component its reward is served from, or a clear error for a card that serves
    none, or that cannot score the images the card `scores` (a Card) makes — from the manifests and the weights'
    digests, so a command checks its judges before hours of training, not after."""
    from cardtool.core.cards.discovery import locate
    from cardtool.core.cards.loader import load_card

    card = load_card(locate(ref), checksums=True)
    problem = not_a_reward(card) or (cannot_score(card, scores) if scores is not None else None)
    if problem:
        raise BadInput(problem)
    kinds = {spec.kind for spec in card.manifest.components.values()}
    return card, next(kind for kind in REWARD_KINDS if kind in kinds)


def check_held_out(held_out: str | None, reward: str | None, judge: str | None = None) -> None:
    """A held-out judge is one the policy was not trained on — its accuracy beside the reward's is what shows reward
    hacking; the reward card itself (the same folder, or a copy by its id) would only measure the reward again, and
    the eval's own `judge` would measure the eval again (a second eval, recorded as another judge's). `reward`: None
    for a run without one (a distillation)."""
    if not held_out:
        return
    card = reward_card(held_out)[0]

    def same(other) -> bool:
        return card.id == other.id or card.folder.resolve() == other.folder.resolve()

    trained_on = reward_card(reward)[0] if reward is not None else None
    if trained_on is not None and same(trained_on):
        raise BadInput(f"--held-out-judge {held_out} is the reward card '{trained_on.id}': a held-out judge is one "
                       "the policy is not trained on, so that its accuracy can show reward hacking; give another "
                       "judge (fashion-referee), or '' for none")
    if judge is not None and same(eval_judge := reward_card(judge)[0]):
        raise BadInput(f"--held-out-judge {held_out} is the --judge card '{eval_judge.id}': its accuracy would be the "
                       "eval's again; give a second judge, or '' for none")


def not_a_reward(card) -> str | None:
    """Why `card` serves no reward (None: it does): no component of a reward kind, or a classifier that does not
    tell Fashion-MNIST's classes — the judge takes the probability of the class a prompt names."""
    components = card.manifest.components.values()
    kinds = {spec.kind for spec in components}
    if not kinds & set(REWARD_KINDS):
        return (f"card '{card.id}' is not a reward: a reward card serves a component of kind "
                f"{' or '.join(REWARD_KINDS)}, and it has {', '.join(sorted(kinds)) or 'none'}")
    classes = next((spec.config.get("classes", len(CLASS_NAMES)) for spec in components
                    if spec.kind == "classifier" and isinstance(spec.config, dict)), len(CLASS_NAMES))
    if classes != len(CLASS_NAMES):
        return (f"card '{card.id}' is not a Fashion-MNIST judge: its classifier tells {classes} "
                f"class{'es' if classes != 1 else ''}, not the {len(CLASS_NAMES)} prompts name "
                f"({', '.join(CLASS_NAMES)})")
    return None


def cannot_score(reward, card) -> str | None:
    """Why the reward card `reward` cannot score the images `card` makes (None: it can): they are of another size
    than the judge's input."""
    size = image_size(card)
    if size is None or size == JUDGED_SIZE:
        return None
    return (f"card '{card.id}' makes {size}×{size} images; reward card '{reward.id}' judges "
            f"{JUDGED_SIZE}×{JUDGED_SIZE} ones (Fashion-MNIST's)")


def image_size(card) -> int | None:
    """The size of the images `card`'s denoise loop makes — its conv-vae's image_size — or None where it makes none
    of a known size."""
    from cardtool.backends.vae_config import ConvVAEConfig

    loop = card.manifest.loops.get("denoise")
    components = card.manifest.components
    vaes = [components[name] for name in (loop.uses if loop else []) if name in components
            and components[name].kind == "vae" and components[name].impl == "conv-vae"]
    return ConvVAEConfig.from_card(vaes[0].config).image_size if len(vaes) == 1 else None
