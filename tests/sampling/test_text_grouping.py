"""Many missing prompts are encoded in fixed groups only where a trial shows that gives each the bits it gets alone."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from cardtool.backends.platform import Platform
from cardtool.core.cards.loader import load_card
from cardtool.core.sampling import text_cache
from cardtool.core.sampling.instance import ModelInstance
from cardtool.core.sampling.text_cache import GROUPED_FROM, TEXT_GROUP, TextFeatureCache, encode_prompts

LENGTH = 6


class Arrays:
    to_numpy = staticmethod(np.asarray)


class Encoder:
    """A row's features from its prompt alone (a hash), unless `drift` says how a group shifts a row: the rounding
    of another BLAS path. Records each call's prompts."""

    def __init__(self, drift=lambda prompt, rows: 0.0):
        self.calls, self.drift = [], drift

    def __call__(self, prompts):
        self.calls.append(list(prompts))
        states, mask = np.zeros((len(prompts), LENGTH, 3), np.float32), np.zeros((len(prompts), LENGTH), bool)
        for row, prompt in enumerate(prompts):
            seed = int.from_bytes(hashlib.sha256(prompt.encode()).digest()[:4], "little")
            states[row] = np.random.default_rng(seed).standard_normal((LENGTH, 3)) + self.drift(prompt, len(prompts))
            mask[row, :min(LENGTH, 1 + len(prompt.split()))] = True
        return states, mask


def alone(prompts):
    encoder = Encoder()
    return [tuple(part[0] for part in encoder([p])) for p in prompts]


def same(actual, expected):
    return all(np.array_equal(a, b) for one, other in zip(actual, expected, strict=True)
               for a, b in zip(one, other, strict=True))


PROMPTS = [f"a bag number {i}" for i in range(100)]


def test_many_prompts_go_in_full_groups_each_with_an_empty_prompt_and_get_their_alone_bits():
    encoder = Encoder()
    encoded = list(text_cache._encoded(encoder, Arrays, PROMPTS))
    assert same(encoded, alone(PROMPTS))
    groups = [call for call in encoder.calls if len(call) > 1]
    trial = TEXT_GROUP - 2
    assert encoder.calls[:trial + 2] == [[p] for p in [*PROMPTS[:trial], "", "x " * 4096]]  # the trial, alone
    assert groups[0] == [*PROMPTS[:trial], "", "x " * 4096]  # … and as one group
    assert len(encoder.calls) == trial + 2 + 1 + -(-(len(PROMPTS) - trial) // (TEXT_GROUP - 1))
    assert all(len(group) == TEXT_GROUP and "" in group for group in groups)
    assert [p for group in groups[1:] for p in group if p] == PROMPTS[trial:]
    assert text_cache._exact[encoder] is True
    encoder.calls.clear()  # the verdict is kept: the next call goes straight to groups
    list(text_cache._encoded(encoder, Arrays, PROMPTS))
    assert all(len(call) == TEXT_GROUP for call in encoder.calls)


@pytest.mark.parametrize("drift", [
    lambda prompt, rows: 1e-6 * (rows > 1),  # every row of a group
    lambda prompt, rows: 1e-6 * (rows > 1 and len(prompt) > 1000),  # a prompt filling every token, in a group
    lambda prompt, rows: 1e-6 * (rows > 1 and not prompt),  # the empty prompt, in a group
], ids=["every row", "a filled prompt", "the empty prompt"])
def test_where_a_group_rounds_differently_every_prompt_is_encoded_alone(drift):
    encoder = Encoder(drift)
    encoded = list(text_cache._encoded(encoder, Arrays, PROMPTS))
    assert same(encoded, alone(PROMPTS))
    assert text_cache._exact[encoder] is False
    assert sum(len(call) > 1 for call in encoder.calls) == 1  # the trial's group alone


def test_an_encoder_that_refuses_a_probe_encodes_each_prompt_alone_without_an_error():
    """A plugin's encoder may refuse a prompt longer than it reads: the trial's probe is not the user's to fail on."""
    class Refusing(Encoder):
        def __call__(self, prompts):
            if any(len(p) > 1000 for p in prompts):
                raise ValueError("prompt too long for this encoder")
            return super().__call__(prompts)

    encoder = Refusing()
    assert same(list(text_cache._encoded(encoder, Arrays, PROMPTS)), alone(PROMPTS))
    assert text_cache._exact[encoder] is False and all(len(call) == 1 for call in encoder.calls)


def test_a_few_prompts_are_encoded_alone_without_a_trial():
    encoder = Encoder()
    list(text_cache._encoded(encoder, Arrays, PROMPTS[:GROUPED_FROM - 1]))
    assert encoder.calls == [[p] for p in PROMPTS[:GROUPED_FROM - 1]] and encoder not in text_cache._exact


def test_the_built_in_encoder_gives_many_prompts_their_alone_features(examples):
    """Whichever way the trial goes on this machine, the features are the ones each prompt gets alone."""
    instance = ModelInstance(load_card(examples / "tiny-base"), Platform("cpu", "generic"))
    prompts = [f"a {shade} {garment} {i}" for i in range(12) for shade in ("dark", "light")
               for garment in ("bag", "coat", "boot")]
    prompts[5] = "a very long striped shirt with a collar, two pockets, buttons and a belt and laces " * 2
    many = encode_prompts(instance, prompts, TextFeatureCache(disk=False))
    one_by_one = [encode_prompts(instance, [p], TextFeatureCache(disk=False))[0] for p in prompts]
    assert len(prompts) >= GROUPED_FROM and same(many, one_by_one)
