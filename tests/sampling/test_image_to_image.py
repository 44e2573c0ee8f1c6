"""`generate --image IMAGE --strength S`: image-to-image (SDEdit) — the start image encoded, re-noised to σ = S with
each request's seed and denoised from there; recorded in the PNG and made again by `--like`."""

from __future__ import annotations

import json

import numpy as np
import pytest
from helpers import REPO
from PIL import Image
from typer.testing import CliRunner

from cardtool.cli import app
from cardtool.core.sampling.denoise import Request
from cardtool.core.sampling.generate import LoadedCard
from cardtool.core.sampling.sampler import sample
from cardtool.errors import BadInput

FASHION_BASE = str(REPO / "cards" / "fashion-base")  # trained: what it keeps of an image is measurable


def run(*args):
    return CliRunner().invoke(app, list(args))


def pixels(path) -> np.ndarray:
    return np.asarray(Image.open(path))


@pytest.fixture
def tiny(examples, monkeypatch):
    monkeypatch.setenv("CARDTOOL_PATH", str(examples))
    return LoadedCard("tiny-base")


def test_the_image_is_encoded_renoised_to_the_strength_and_denoised(tiny, tmp_path):
    start = tiny.generate("an ankle boot", steps=2, out=tmp_path / "boot.png").images[0]
    result = run("generate", "tiny-base", "-p", "a bag", "-n", "2", "--steps", "4", "--image", str(start.path),
                 "--strength", "0.5", "--out", str(tmp_path / "out"), "--json")
    assert result.exit_code == 0, result.output
    made = json.loads(result.stdout)["images"]
    assert [m["strength"] for m in made] == ["0.5", "0.5"]
    assert made[0]["image"] == {"sha256": made[1]["image"]["sha256"], "source": str(start.path)}
    # the same work by hand: the VAE's latent of the image, re-noised from σ = 0.5 on the 4-step grid (steps 2 and 3)
    loop = tiny.loop()
    latent = loop.encode(start.pixels[None])[0]
    requests = [Request("a bag", seed=s, steps=4, guidance=4.0, strength=0.5) for s in (0, 1)]
    states = sample(loop, requests, sources=[latent, latent])
    assert [s.step for s in states] == [4, 4] and requests[0].first_step(states[0].sigmas) == 2
    by_hand = loop.finalize(states)
    assert all((pixels(m["path"]) == image).all() for m, image in zip(made, by_hand, strict=True))
    plain = tiny.generate("a bag", num=2, steps=4, out=tmp_path / "out")
    assert {i.path for i in plain.images}.isdisjoint(m["path"] for m in made), "another image, another file"
    assert not any((i.pixels == pixels(m["path"])).all() for i, m in zip(plain.images, made, strict=True))


def test_a_lower_strength_keeps_more_of_the_image():
    card = LoadedCard(FASHION_BASE)
    boot = card.generate("an ankle boot", out=None).images[0].pixels

    def distance(**options) -> float:
        images = card.generate("a bag", num=2, out=None, **options).images
        return float(np.mean([np.abs(i.pixels.astype(float) - boot).mean() for i in images]))

    near, middle, far = (distance(image=boot, strength=s) for s in (0.1, 0.5, 0.95))
    plain = distance()
    assert near < 15 < middle < far < plain + 5 and plain > 40, (near, middle, far, plain)


def test_like_makes_an_image_to_image_result_again(tiny, tmp_path):
    start = tiny.generate("an ankle boot", steps=2, out=tmp_path / "boot.png").images[0]
    made = tiny.generate("a bag", seed=3, steps=4, image=str(start.path), strength=0.6, out=tmp_path / "out")
    again = run("generate", "--like", str(made.images[0].path), "--out", str(tmp_path / "again.png"))
    assert again.exit_code == 0, again.output
    assert (pixels(tmp_path / "again.png") == made.images[0].pixels).all() and "not made again" not in again.output
    other = run("generate", "--like", str(made.images[0].path), "--strength", "0.3", "--out", str(tmp_path / "o.png"))
    assert other.exit_code == 0 and Image.open(tmp_path / "o.png").text["strength"] == "0.3"
    moved = start.path.rename(tmp_path / "elsewhere.png")
    lost = run("generate", "--like", str(made.images[0].path), "--out", str(tmp_path / "lost.png"))
    assert lost.exit_code == 2 and "was made from the image" in lost.stderr and "--image IMAGE" in lost.stderr
    given = run("generate", "--like", str(made.images[0].path), "--image", str(moved), "--out", str(tmp_path / "g.png"))
    assert given.exit_code == 0 and (pixels(tmp_path / "g.png") == made.images[0].pixels).all()
    assert "not made again" not in given.output, "the same image from another file is the same request"
    array = tiny.generate("a bag", steps=4, image=start.pixels, strength=0.6, out=tmp_path / "array")
    assert (array.images[0].pixels == tiny.generate("a bag", steps=4, image=str(moved), strength=0.6,
                                                    out=None).images[0].pixels).all()
    refused = run("generate", "--like", str(array.images[0].path), "--out", str(tmp_path / "r.png"))
    assert refused.exit_code == 2 and "given as an array" in refused.stderr


def test_each_prompt_may_start_from_its_own_image(tiny, tmp_path):
    boot, bag = (tiny.generate(p, steps=2, out=tmp_path / f"{p}.png").images[0] for p in ("a boot", "a bag"))
    result = run("generate", "tiny-base", "-p", "a coat", "-p", "a dress", "-n", "2", "--steps", "3", "--image",
                 str(boot.path), "--image", str(bag.path), "--strength", "0.6", "--out", str(tmp_path / "out"),
                 "--json")
    assert result.exit_code == 0, result.output
    made = json.loads(result.stdout)["images"]
    assert [m["image"]["source"] for m in made] == [str(boot.path)] * 2 + [str(bag.path)] * 2
    for prompt, start, pair in (("a coat", boot, made[:2]), ("a dress", bag, made[2:])):
        alone = tiny.generate(prompt, num=2, steps=3, image=start.pixels, strength=0.6, out=None).images
        assert all((pixels(m["path"]) == a.pixels).all() for m, a in zip(pair, alone, strict=True)), \
            "each prompt's images are those it makes alone from its image"
    with pytest.raises(BadInput, match="3 given for 2 prompts"):
        tiny.generate(["a coat", "a dress"], steps=1, image=[boot.pixels] * 3, out=None)
    miscounted = run("generate", "tiny-base", "-p", "a coat", "--image", str(boot.path), "--image", str(bag.path),
                     "--out", str(tmp_path / "never"))
    assert miscounted.exit_code == 2 and "2 given for 1 prompt\n" in miscounted.stderr


def test_like_warns_when_the_recorded_image_file_changed(tiny, tmp_path):
    start = tiny.generate("a boot", steps=2, out=tmp_path / "start.png").images[0]
    made = tiny.generate("a bag", steps=3, image=str(start.path), strength=0.6, out=tmp_path / "made.png").images[0]
    tiny.generate("a coat", steps=2, out=start.path)  # another picture under the recorded name
    again = run("generate", "--like", str(made.path), "--out", str(tmp_path / "again.png"))
    assert again.exit_code == 0 and "this run differ in image: its image is not made" in again.stderr, again.output


def test_best_of_n_starts_every_candidate_from_the_image(tiny, examples, tmp_path):
    start = tiny.generate("an ankle boot", steps=2, out=None).images[0].pixels
    best = tiny.generate("a bag", steps=3, image=start, strength=0.7, best_of=3, reward=str(examples / "tiny-judge"),
                         out=None).images[0]
    alone = tiny.generate("a bag", seed=int(best.metadata["seed"]), steps=3, image=start, strength=0.7, out=None)
    assert (alone.images[0].pixels == best.pixels).all(), "the winner is its own seed's image-to-image result"


@pytest.mark.parametrize("args, message", [
    (["--strength", "0.5"], "--strength applies to the image to start from; give --image IMAGE"),
    (["--mask", "{start}"], "--mask applies to the image to start from; give --image IMAGE"),
    (["--image", "{start}", "--strength", "1"], "--strength must be a number in (0, 1) — 1 would forget the image"),
    (["--image", "{start}", "--mask", "{start}", "--strength", "1.5"], "--strength must be a number in (0, 1]"),
    (["--image", "{start}", "--strength", "0"], "--strength must be a number in (0, 1)"),
    (["--image", "{tmp}/missing.png"], "cannot read the image to start from"),
    (["--image", "{tmp}/broken.png"], "cannot read the image to start from"),
])
def test_bad_image_to_image_requests_are_clear_errors(tiny, tmp_path, args, message):
    start = tiny.generate("an ankle boot", steps=1, out=tmp_path / "boot.png").images[0].path
    (tmp_path / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\nnot really")
    args = [a.format(start=start, tmp=tmp_path) for a in args]
    result = run("generate", "tiny-base", "-p", "a bag", "--steps", "2", *args, "--out", str(tmp_path / "out"))
    assert result.exit_code == 2 and message in result.stderr, result.output
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("mask", [False, True])
def test_numpy_starts_from_an_image_as_torch_does(tiny, tmp_path, mask):
    """numpy's VAE encodes too (its reference forward): image-to-image and inpainting there give torch's images, and
    a VAE with no encoder (a plugin's) is refused before any work."""
    start = tiny.generate("an ankle boot", steps=2, out=tmp_path / "boot.png").images[0].path
    masked = ["--mask", str(REPO / "examples" / "workflows" / "bottom-half.png")] if mask else []
    made = {}
    for device in ("cpu", "numpy"):  # cpu first: numpy reads the prompt's features from the cache it fills
        result = run("generate", "tiny-base", "-p", "a bag", "-n", "2", "--steps", "3", "--image", str(start),
                     "--strength", "0.6", *masked, "--device", device, "--json", "--out", str(tmp_path / device))
        assert result.exit_code == 0 and json.loads(result.stdout)["platform"].startswith(device), result.output
        made[device] = [pixels(image["path"]).astype(int) for image in json.loads(result.stdout)["images"]]
    assert all(np.abs(a - b).max() <= 1 for a, b in zip(made["cpu"], made["numpy"], strict=True))
    assert np.abs(made["numpy"][0] - made["numpy"][1]).max() > 0, "two seeds, two images"


def test_a_vae_with_no_encoder_is_refused_an_image_to_start_from(tiny, tmp_path, monkeypatch):
    from cardtool.backends.numpy_conv_vae import NumpyConvVAE

    start = tiny.generate("an ankle boot", steps=1, out=tmp_path / "boot.png").images[0].path
    monkeypatch.delattr(NumpyConvVAE, "encode")
    result = run("generate", "tiny-base", "-p", "an ankle boot", "--steps", "2", "--image", str(start), "--device",
                 "numpy", "--out", str(tmp_path / "out"))
    assert result.exit_code == 2, result.output
    assert "the VAE of 'tiny-base' on numpy has no encoder; starting from an image needs the torch platform" in \
        result.stderr
    assert not (tmp_path / "out").exists()


def test_the_api_refuses_an_image_array_of_another_size_or_kind(tiny):
    for image, message in [(np.zeros((20, 20), np.uint8), "the card takes 28×28 images"),
                           (np.zeros((28, 28)), "a file, a PIL image or a grey uint8 \\(H, W\\) array"),
                           (3, "a grey uint8")]:
        with pytest.raises(BadInput, match=message):
            tiny.generate("a bag", steps=1, image=image, out=None)
    with pytest.raises(BadInput, match="strength must be a number"):
        tiny.generate("a bag", steps=1, image=np.zeros((28, 28), np.uint8), strength="0.5", out=None)


def test_a_pil_image_is_read_as_the_same_picture_saved_as_a_file_is(tiny, tmp_path):
    """A script's (or a diffusers pipeline's) Pillow image, in any mode and size: grey and resized as a file is."""
    rng = np.random.default_rng(0)
    colour = Image.fromarray(rng.integers(0, 256, size=(56, 56, 3), dtype=np.uint8), "RGB")
    colour.save(tmp_path / "start.png")
    cut_out = colour.convert("RGBA")
    cut_out.putalpha(Image.fromarray(np.where(np.arange(56)[:, None] < 28, 255, 0).repeat(56, 1).astype(np.uint8)))
    cut_out.save(tmp_path / "cut.png")
    mask = Image.fromarray(np.where(np.arange(28)[:, None] < 14, 0, 255).repeat(28, 1).astype(np.uint8), "L")
    mask.save(tmp_path / "mask.png")
    for picture, file in ((colour, "start.png"), (cut_out, "cut.png")):
        from_file, from_pil = (tiny.generate("a bag", steps=2, image=i, strength=0.5, mask=m, out=None).images[0]
                               for i, m in ((str(tmp_path / file), str(tmp_path / "mask.png")), (picture, mask)))
        assert (from_pil.pixels == from_file.pixels).all(), file
        assert json.loads(from_pil.metadata["image"])["sha256"] == json.loads(from_file.metadata["image"])["sha256"]
        assert json.loads(from_pil.metadata["mask"])["sha256"] == json.loads(from_file.metadata["mask"])["sha256"]
    assert json.loads(from_pil.metadata["image"])["source"] == "", "not a file"
    for unusable, message in ((Image.new("L", (0, 28)), "the image to start from is an empty image \\(0×28 pixels\\)"),
                              (Image.new("LAB", (28, 28)), "cannot use the image to start from \\(LAB image\\): "
                                                           "ValueError: conversion from LAB")):
        with pytest.raises(BadInput, match=message):
            tiny.generate("a bag", steps=1, image=unusable, out=None)


def test_inpainting_keeps_the_unmasked_cells_latent_exactly_and_generates_the_rest(tiny):
    loop = tiny.loop()
    start = tiny.generate("a boot", steps=2, out=None).images[0].pixels
    mask = np.zeros((28, 28), np.uint8)
    mask[0, 0] = mask[20:, :] = 255  # the corner pixel and the bottom rows
    keep = np.asarray(loop.latent_mask(mask))
    # 28 → 32 padded by 2 a side, cells of 4: pixel (0, 0) is padded (2, 2), in cell (0, 0); rows 20… are 22…, cells 5…
    expected = np.ones((8, 8))
    expected[0, 0] = expected[5:, :] = 0
    assert keep.shape == (1, 1, 1, 8, 8) and np.array_equal(keep[0, 0, 0], expected)
    latent = loop.encode(start[None])[0]
    requests = [Request("a bag", seed=s, steps=4, guidance=4.0, strength=strength) for s, strength in ((0, 1.0),
                                                                                                      (1, 0.6))]
    states = sample(loop, requests, sources=[latent, latent], keeps=[loop.latent_mask(mask)] * 2)
    source = np.asarray(latent)
    for state in states:
        final = np.asarray(state.latents)
        kept = np.broadcast_to(expected.astype(bool), final.shape)
        assert np.array_equal(final[kept], source[kept]), "kept cells end on the image's own latent, bit for bit"
        assert not np.allclose(final[~kept], source[~kept]), "the masked cells are generated"
    assert states[0].step == states[1].step == 4 and requests[1].first_step(states[1].sigmas) == 2
    # on the way, too: after each step to σ' the kept cells are the image's latent re-noised, (1 − σ')·x + σ'·ε
    states = sample(loop, requests[:1], capture=True, sources=[latent], keeps=[loop.latent_mask(mask)])
    noise = np.asarray(states[0].keep[2])
    for step, sigma_next in enumerate(states[0].sigmas[1:]):
        path = np.asarray(states[0].capture.latents[step + 1])
        np.testing.assert_allclose(path[kept], ((1 - sigma_next) * source + sigma_next * noise)[kept], atol=1e-6)


def test_a_masks_white_from_128_is_generated_and_a_mask_of_another_size_is_refused(tiny):
    loop = tiny.loop()
    mask = np.zeros((28, 28), np.uint8)
    mask[0, 0], mask[27, 27] = 127, 128  # padded (2, 2) in cell (0, 0), (29, 29) in cell (7, 7)
    mask[2, 2] = 255  # padded by 2 a side: (4, 4), the first pixel of cell (1, 1)
    keep = np.asarray(loop.latent_mask(mask))[0, 0, 0]
    assert keep[0, 0] == 1 and keep[7, 7] == 0 and keep[1, 1] == 0 and keep.sum() == 62
    with pytest.raises(BadInput, match="a mask for card 'tiny-base' is 28×28, got 20×10"):
        loop.latent_mask(np.zeros((10, 20), np.uint8))


def test_an_image_is_never_written_over_the_image_or_mask_it_is_made_from(tiny, tmp_path, examples):
    start = tiny.generate("a boot", steps=2, out=tmp_path / "start.png").images[0].path
    mask = tmp_path / "mask.png"
    Image.fromarray(np.full((28, 28), 255, np.uint8)).save(mask)
    before = start.read_bytes(), mask.read_bytes()
    for args, option, read in ((["--strength", "0.5"], "--image", start), (["--mask", str(mask)], "--mask", mask)):
        out = tmp_path / ".." / tmp_path.name / read.name  # the same file, named another way
        result = run("generate", str(examples / "tiny-base"), "-p", "a bag", "--steps", "2", "--image", str(start),
                     *args, "--out", str(out), "--json")
        assert result.exit_code == 2, result.output
        assert json.loads(result.stdout)["error"]["message"] == (
            f"--out {out} is the {option} file this call reads ({read}): the image written there would replace it; "
            "give another --out")
    assert (start.read_bytes(), mask.read_bytes()) == before
    other = tiny.generate("a bag", steps=2, image=start, strength=0.5, out=tmp_path / "other.png").images[0]
    assert other.path == tmp_path / "other.png" and start.read_bytes() == before[0]


def test_inpainting_from_the_command_line_keeps_the_top_and_is_made_again_by_like(tmp_path):
    card = LoadedCard(FASHION_BASE)
    dress = card.generate("a dress", out=tmp_path / "dress.png").images[0]
    mask = np.zeros((28, 28), np.uint8)
    mask[16:] = 255
    Image.fromarray(mask).save(tmp_path / "bottom.png")
    result = run("generate", FASHION_BASE, "-p", "a bag", "-n", "2", "--image", str(dress.path), "--mask",
                 str(tmp_path / "bottom.png"), "--out", str(tmp_path / "out"), "--json")
    assert result.exit_code == 0, result.output
    made = json.loads(result.stdout)["images"]
    assert made[0]["mask"]["source"] == str(tmp_path / "bottom.png") and "strength" not in made[0], "strength 1"
    for m in made:
        image = pixels(m["path"]).astype(float)
        top, bottom = (np.abs(image[rows] - dress.pixels[rows]).mean() for rows in (slice(0, 12), slice(16, 28)))
        assert top < 10 < 30 < bottom, (top, bottom)  # measured 3.7–6.2 against 36–88 over eight images
    again = run("generate", FASHION_BASE, "--like", made[1]["path"], "--out", str(tmp_path / "again.png"))
    assert again.exit_code == 0 and (pixels(tmp_path / "again.png") == pixels(made[1]["path"])).all(), again.output
    inverted = run("generate", FASHION_BASE, "--like", made[1]["path"], "--mask", str(dress.path), "--out",
                   str(tmp_path / "i.png"))
    assert inverted.exit_code == 0 and not (pixels(tmp_path / "i.png") == pixels(made[1]["path"])).all()
    assert Image.open(tmp_path / "i.png").text["mask"] != Image.open(made[1]["path"]).text["mask"]


def test_an_all_white_mask_is_plain_sampling_and_an_all_black_one_the_image_itself(tiny):
    start = tiny.generate("a boot", steps=2, out=None).images[0].pixels
    white, black = np.full((28, 28), 255, np.uint8), np.zeros((28, 28), np.uint8)
    plain = tiny.generate("a bag", num=2, steps=3, out=None).images
    everything = tiny.generate("a bag", num=2, steps=3, image=start, mask=white, out=None).images
    assert all(np.array_equal(a.pixels, b.pixels) for a, b in zip(plain, everything, strict=True)), \
        "nothing kept at strength 1: the image is forgotten, as plain sampling from the same noise"
    nothing = tiny.generate("a bag", steps=3, image=start, mask=black, strength=0.7, out=None).images[0]
    loop = tiny.loop()
    latent = loop.encode(start[None])[0]
    state = sample(loop, [Request("a bag", steps=1, guidance=1.0, strength=1.0)], sources=[latent],
                   keeps=[loop.latent_mask(black)])[0]
    assert np.array_equal(np.asarray(state.latents), np.asarray(latent))
    assert np.array_equal(nothing.pixels, loop.finalize([state])[0]), "everything kept: the image's reconstruction"


def test_an_image_start_below_the_guidance_interval_is_warned_of_once(tiny):
    """4 steps on shift 1 start at σ 1, 0.75, 0.5, 0.25; strength 0.5 runs the last two, so an interval of 0.7,0.8
    (inside the grid, above the start) guides no step the image is denoised by — said, with where it started; an
    interval no step of the grid falls in is said once, not once for the grid and once for the start."""
    start = np.zeros((28, 28), np.uint8)
    for interval, said in (((0.7, 0.8), True), ((0.3, 0.4), True), ((0.4, 0.6), False)):
        report = tiny.generate("a bag", steps=4, guidance=4.0, guidance_interval=interval, image=start, strength=0.5,
                               out=None)
        unguided = [w for w in report.warnings if "applies to none" in w]
        assert unguided == ([f"no step's σ lies in the guidance interval {interval[0]:g},{interval[1]:g} (4 steps on "
                             "shift 1, from σ 0.5 at strength 0.5): guidance 4 applies to none, and the images are "
                             "those of guidance 1; widen the interval"] if said else []), interval
    plain = tiny.generate("a bag", steps=4, guidance=4.0, guidance_interval=(0.7, 0.8), out=None)
    assert not [w for w in plain.warnings if "applies to none" in w], "from noise the σ 0.75 step is guided"
