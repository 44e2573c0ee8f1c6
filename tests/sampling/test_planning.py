"""A generate call's plan (sampling/planning.py): prompts × seeds in order, at most MAX_IMAGES of them, prompts
files and piped prompts of bounded size, the card's defaults for what is not given, and the Python API's adapter
stack checked as the command line's."""

from __future__ import annotations

import pytest
from helpers import EXAMPLE_CARDS, REPO

from cardtool.core.cards.loader import load_card
from cardtool.core.sampling.planning import MAX_IMAGES, plan_requests, read_prompts_file
from cardtool.errors import BadInput


@pytest.fixture(scope="module")
def card():
    return load_card(EXAMPLE_CARDS / "tiny-base")


def test_each_prompt_takes_the_seeds_from_the_first_in_turn(card):
    requests, warnings = plan_requests(card, ["a bag", "a coat"], num=2, seed=5, steps=3)
    assert [(r.prompt, r.seed, r.steps) for r in requests] == [("a bag", 5, 3), ("a bag", 6, 3), ("a coat", 5, 3),
                                                               ("a coat", 6, 3)]
    assert warnings == []


def test_at_most_max_images_are_planned(card):
    assert MAX_IMAGES == 100_000
    requests, _ = plan_requests(card, ["a bag", "a coat"], num=MAX_IMAGES // 2)
    assert len(requests) == MAX_IMAGES and requests[-1].seed == MAX_IMAGES // 2 - 1
    for prompts, num in ((["a bag", "a coat"], MAX_IMAGES // 2 + 1), (["a bag"], MAX_IMAGES + 1), (["a bag"], 0)):
        with pytest.raises(BadInput, match=f"prompts × num at most 100,000, got {len(prompts)} × {num}"):
            plan_requests(card, prompts, num=num)


def test_a_prompts_file_of_up_to_16_mib_is_read(tmp_path):
    line = "a bag\n"
    path = tmp_path / "prompts.txt"
    path.write_text("\ufeff# comment\n\n" + line * ((16 << 20) // len(line) - 3) + "a coat")
    assert path.stat().st_size <= 16 << 20
    prompts = read_prompts_file(path)
    assert prompts[0] == "a bag" and prompts[-1] == "a coat" and "# comment" not in prompts
    path.write_bytes(b"a" * ((16 << 20) + 1))
    with pytest.raises(BadInput, match=f"cannot read prompts file: {path} is larger than {16 << 20} bytes"):
        read_prompts_file(path)


def test_a_prompts_file_may_be_a_pipe_but_not_a_device_or_a_folder(tmp_path):
    """`--prompts-file <(…)` is a pipe: read until its writer closes it, as far as the limit; /dev/zero never ends."""
    import os
    import threading

    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    writer = threading.Thread(target=lambda: fifo.write_bytes("\ufeff# made by a script\na bag\na coat\n".encode()))
    writer.start()
    assert read_prompts_file(fifo) == ["a bag", "a coat"]
    writer.join()
    writer = threading.Thread(target=lambda: fifo.write_bytes(b"x" * 101))
    writer.start()
    with pytest.raises(BadInput, match=f"cannot read prompts file: {fifo} is larger than 100 bytes"):
        read_prompts_file(fifo, limit=100)
    writer.join()
    for path, why in (("/dev/zero", "is not a regular file"), (tmp_path, "is not a regular file"),
                      (tmp_path / "nope.txt", "does not exist")):
        with pytest.raises(BadInput, match=f"cannot read prompts file: {path} {why}"):
            read_prompts_file(path)


def test_a_control_scale_without_a_control_image_is_refused(card):
    with pytest.raises(BadInput, match="--control-scale sets the scale of the ControlNet --control adds; give it with "
                                       "--control"):
        plan_requests(card, ["a bag"], control_scale=0.5)


def test_prompts_piped_in_are_read_up_to_16_mib_and_not_cut_short_past_it(monkeypatch):
    import io
    import sys

    for size, refused in (((16 << 20), False), ((16 << 20) + 1, True)):
        data = b"a bag\n" + b"b" * (size - 6)
        monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(data)))
        if refused:
            with pytest.raises(BadInput, match=f"standard input is larger than {16 << 20} bytes"):
                read_prompts_file("-")
        else:
            prompts = read_prompts_file("-")
            assert prompts[0] == "a bag" and len(prompts[1]) == size - 6


@pytest.mark.parametrize("adapters", [[("invert",)], [("invert", 0.5, 1)], [("invert", True)], [(1, 0.5)],
                                      [("invert", "0.5")], ("invert", 0.5), "invert=0.5", [["invert", None]]])
def test_adapters_that_are_not_name_scale_pairs_are_refused(card, adapters):
    with pytest.raises(BadInput, match=r"adapters must be \(name, scale\) pairs"):
        plan_requests(card, ["a bag"], adapters=adapters)


def test_an_adapter_scale_float32_holds_is_taken_and_one_past_it_refused(card):
    import numpy as np

    largest = float(np.finfo(np.float32).max)
    requests, _ = plan_requests(card, ["a bag"], adapters=[("invert", -largest)])
    assert requests[0].adapters == (("invert", -largest),)
    for scale in (np.nextafter(largest, np.inf), float("inf"), float("nan")):
        with pytest.raises(BadInput, match="adapter 'invert': a scale of .* is beyond float32's range"):
            plan_requests(card, ["a bag"], adapters=[("invert", float(scale))])


def test_settings_given_replace_the_card_s_defaults_and_the_rest_come_from_it(card):
    defaults = card.manifest.loops["denoise"].defaults
    [plain], _ = plan_requests(card, ["a bag"])
    assert (plain.steps, plain.guidance, plain.shift, plain.solver) == (defaults["steps"], defaults["guidance"],
                                                                        defaults["shift"], defaults["solver"])
    assert plain.guidance_interval == (0.0, 1.0) and plain.adapters == () and plain.negative_prompt == ""
    [given], _ = plan_requests(card, ["a bag"], steps=2, guidance=1.5, shift=2.0, solver="dpmpp_2m",
                               guidance_interval=(0.1, 0.5), adapters=[("invert", 0.25)], negative_prompt="a coat")
    assert (given.steps, given.guidance, given.shift, given.solver, given.guidance_interval, given.adapters,
            given.negative_prompt) == (2, 1.5, 2.0, "dpmpp_2m", (0.1, 0.5), (("invert", 0.25),), "a coat")
    [listed], _ = plan_requests(card, ["a bag"], adapters=[["invert", 1]])  # a list is a pair too; its scale a float
    assert listed.adapters == (("invert", 1.0),)


def test_a_guidance_interval_no_step_falls_in_is_warned_of(card):
    """CFG applies on the steps whose starting σ lies in the interval: on 4 steps of shift 1 (σ 1, 0.75, 0.5, 0.25)
    an interval of 0.3,0.4 or 0,0 guides none, so guidance 4 gives the images of guidance 1 — said, not silent."""
    for interval, warned in (((0.3, 0.4), True), ((0.0, 0.0), True), ((0.25, 0.3), False), ((0.0, 1.0), False)):
        requests, warnings = plan_requests(card, ["a bag"], steps=4, shift=1.0, guidance=4.0,
                                           guidance_interval=interval)
        assert any("applies to none" in w for w in warnings) == warned, interval
        assert requests[0].model_evaluations() == (4 if warned else 4 + sum(
            interval[0] <= s <= interval[1] for s in (1.0, 0.75, 0.5, 0.25))), "the cost says the same"
    _, warnings = plan_requests(card, ["a bag"], steps=4, shift=1.0, guidance=1.0, guidance_interval=(0.3, 0.4))
    assert warnings == ["a guidance interval limits CFG to a σ range; with guidance 1 (no CFG) it changes nothing"], \
        "without CFG there is nothing to apply: the interval asked for is said to change nothing, not dropped silently"
    _, warnings = plan_requests(card, ["a bag"], steps=4, guidance=1.0, guidance_interval=(0.0, 1.0))
    assert warnings == [], "the card's own interval (what --like passes again) is no setting of the user's"
    _, warnings = plan_requests(card, ["a bag"], steps=4, guidance=3.0, guidance_interval=(0.0, 1.0))
    assert warnings == []
    # shift 3 moves the grid up (σ 1, 0.9, 0.75, 0.5): 0,0.5 guides the last step, 0,0.45 none
    _, warnings = plan_requests(card, ["a bag"], steps=4, shift=3.0, guidance=2.0, guidance_interval=(0.0, 0.5))
    assert warnings == []
    _, [warning] = plan_requests(card, ["a bag"], steps=4, shift=3.0, guidance=2.0, guidance_interval=(0.0, 0.45))
    assert warning.startswith("no step's σ lies in the guidance interval 0,0.45 (4 steps on shift 3): guidance 2 "
                              "applies to none, and the images are those of guidance 1")
    _, [warning] = plan_requests(card, ["a bag"], steps=1, guidance=2.0, guidance_interval=(0.0, 0.5))
    assert warning.startswith("no step's σ lies in the guidance interval 0,0.5 (1 step on shift 1)")


def test_a_step_count_the_card_does_not_assume_is_warned_of_in_plain_words():
    student = load_card(REPO / "cards" / "fashion-base-nft-1step")  # a built-in one-step student
    _, [warning] = plan_requests(student, ["a bag"], steps=2)
    assert warning == "card 'fashion-base-nft-1step' assumes 1 step; sampling with 2 may give poor images"


def test_a_prompt_given_twice_is_warned_of_its_images_repeating(card):
    _, warnings = plan_requests(card, ["a bag", "a coat", "a bag"], num=3, seed=5)
    assert warnings == ["prompt 'a bag' is given 2 times: each time with seeds 5…7, so its images repeat bit for bit; "
                        "-n/--num N makes N images of a prompt from N seeds"]
    long = "a coat " * 20
    _, warnings = plan_requests(card, [long, "x", long, "x", "x", "y"])
    assert warnings == [f"prompt {long[:59] + '…'!r} is given 2 times (and 1 other prompt): each time with seed 0, so "
                        "its images repeat bit for bit; -n/--num N makes N images of a prompt from N seeds"]
    assert plan_requests(card, ["a bag", "A bag", "a bag "], num=2)[1] == [], "other text, other prompts"
