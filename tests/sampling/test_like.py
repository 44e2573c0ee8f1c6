"""`generate --like IMAGE`: an image cardtool made is made again from its metadata, bit for bit; options given change
one thing; another card keeps only the prompt and seed; what is not such an image is a clear error."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
from PIL import Image
from typer.testing import CliRunner

from cardtool.cli import app
from cardtool.core.sampling.images import png_bytes, read_png, read_png_metadata

DEEP = "[" * 50_000 + "]" * 50_000


def run(*args):
    result = CliRunner().invoke(app, [*map(str, args), "--json"])
    return result, (json.loads(result.stdout) if result.stdout.strip() else None)


@pytest.fixture
def on_path(examples, monkeypatch):
    monkeypatch.setenv("CARDTOOL_PATH", str(examples))
    return examples


@pytest.fixture
def made(on_path, tmp_path) -> Path:
    result, report = run("generate", "tiny-base", "-p", "a bag", "--seed", "7", "--steps", "3", "--guidance", "2",
                         "--adapter", "invert=0.5", "--out", tmp_path / "a")
    assert result.exit_code == 0, result.output
    return Path(report["images"][0]["path"])


def test_an_image_is_made_again_bit_for_bit_under_the_same_name(made, tmp_path):
    result, report = run("generate", "--like", made, "--out", tmp_path / "b")
    assert result.exit_code == 0, result.output
    again = Path(report["images"][0]["path"])
    assert again.name == made.name and again.read_bytes() == made.read_bytes()
    assert report["warnings"] == []


def test_options_given_change_one_thing_and_keep_the_rest(made, tmp_path):
    result, report = run("generate", "--like", made, "--seed", "20", "-n", "2", "--out", tmp_path / "c")
    assert result.exit_code == 0, result.output
    metadata = [read_png_metadata(image["path"]) for image in report["images"]]
    assert [m["seed"] for m in metadata] == ["20", "21"]
    assert {(m["prompt"], m["steps"], m["guidance"]) for m in metadata} == {("a bag", "3", "2.0")}
    assert all(json.loads(m["adapters"])[0]["scale"] == 0.5 for m in metadata)
    result, report = run("generate", "--like", made, "-p", "a coat", "--steps", "2", "--out", tmp_path / "d")
    [metadata] = [read_png_metadata(image["path"]) for image in report["images"]]
    assert [metadata[k] for k in ("prompt", "seed", "steps", "guidance")] == ["a coat", "7", "2", "2.0"]


def test_fuse_given_with_like_fuses_the_recorded_stack(made, tmp_path):
    """--fuse on an image made unfused: the recorded `fused` is replaced, not passed twice (it raised a TypeError)."""
    result, report = run("generate", "--like", made, "--fuse", "--out", tmp_path / "f")
    assert result.exit_code == 0, result.output
    [metadata] = [read_png_metadata(image["path"]) for image in report["images"]]
    assert metadata["fused"] == "true" and json.loads(metadata["adapters"])[0]["scale"] == 0.5


def test_another_card_keeps_only_the_prompt_and_seed(made, tmp_path):
    result, report = run("generate", "tiny-distilled", "--like", made, "--out", tmp_path / "e")
    assert result.exit_code == 0, result.output
    metadata = read_png_metadata(report["images"][0]["path"])
    assert (metadata["card"], metadata["prompt"], metadata["seed"]) == ("tiny-distilled", "a bag", "7")
    assert (metadata["steps"], metadata["guidance"]) == ("4", "1.0"), "the student's own defaults, not the image's"
    assert "adapters" not in metadata


def test_an_image_made_elsewhere_is_remade_with_a_warning_naming_why_it_differs(made, tmp_path):
    pixels, metadata = read_png(made)
    weights = json.loads(metadata["weights"])
    weights["transformer"] = "0" * 64
    moved = tmp_path / "elsewhere.png"
    moved.write_bytes(png_bytes(pixels, {**metadata, "platform": "cuda/sm90", "weights": json.dumps(weights)}))
    result, report = run("generate", "--like", moved, "--out", tmp_path / "f")
    assert result.exit_code == 0, result.output
    [warning] = report["warnings"]
    here = f"{metadata['platform']} here"
    assert f"differ in weights of transformer; platform (cuda/sm90 there, {here}): its image is not made again bit " \
        "for bit" in warning


def test_best_of_n_is_made_again_from_the_request_seed(on_path, tmp_path):
    result, report = run("generate", "tiny-base", "-p", "a bag", "--seed", "3", "--steps", "2", "--best-of", "3",
                         "--reward", "tiny-judge", "--out", tmp_path / "a")
    assert result.exit_code == 0, result.output
    made = Path(report["images"][0]["path"])
    result, report = run("generate", "--like", made, "--out", tmp_path / "b")
    assert result.exit_code == 0, result.output
    again = Path(report["images"][0]["path"])
    assert again.name == made.name and again.read_bytes() == made.read_bytes()


def test_what_is_not_an_image_cardtool_made_is_refused(made, on_path, tmp_path):
    pixels, metadata = read_png(made)
    jpeg = io.BytesIO()
    Image.fromarray(pixels).save(jpeg, "JPEG")  # the same picture, saved by another tool as a JPEG
    cases = {"no-metadata.png": png_bytes(pixels), "text.png": b"not an image", "photo.jpg": jpeg.getvalue(),
             **{f"no-{key}.png": png_bytes(pixels, {k: v for k, v in metadata.items() if k != key})
                for key in ("cardtool", "card")},
             "workflow.png": png_bytes(pixels, {**metadata, "workflow": "wf", "step": "refine", "input": "draft/0"}),
             # where a refined image's input is looked for comes from its PNG: never a path out of its workflow
             "escape.png": png_bytes(pixels, {**metadata, "workflow": "wf", "input": "../../etc/0",
                                              "input_tag": "deadbeef"}),
             "superscript.png": png_bytes(pixels, {**metadata, "workflow": "wf", "step": "refine", "input": "draft/²",
                                                   "input_tag": "deadbeef"}),
             "bad-steps.png": png_bytes(pixels, {**metadata, "steps": "many"}),
             "inf-guidance.png": png_bytes(pixels, {**metadata, "guidance": "inf"}),
             "bad-adapters.png": png_bytes(pixels, {**metadata, "adapters": "[{"}),
             # JSON nested past the parser's recursion is malformed too, not a RecursionError
             **{f"deep-{key}.png": png_bytes(pixels, {**metadata, key: DEEP}) for key in ("adapters", "control",
                                                                                         "image", "mask")},
             # a card is recorded by its id: a path in a PNG from elsewhere would load whatever it points at
             "path-card.png": png_bytes(pixels, {**metadata, "card": "../../etc/passwd"}),
             "lost-control.png": png_bytes(pixels, {**metadata, "control": json.dumps(
                 {"sha256": "0", "preprocessor": "silhouette", "source": str(tmp_path / "gone.png")})})}
    messages = {"no-metadata.png": "not an image cardtool made", "text.png": "text.png: not a PNG; a generation's",
                "photo.jpg": "photo.jpg: not a PNG; a generation's settings are recorded in the PNG cardtool writes",
                "no-cardtool.png": "not an image cardtool made", "no-card.png": "not an image cardtool made",
                "workflow.png": "made by refining an image of step 'draft' in workflow 'wf', which is not beside it",
                "escape.png": "made by refining an image of step '..' in workflow 'wf', which is not beside it",
                "superscript.png": "made by refining an image of step 'draft' in workflow 'wf', which is not beside",
                "bad-steps.png": "'steps' field is malformed",
                "inf-guidance.png": "'guidance' field is malformed",
                "bad-adapters.png": "'adapters' field is malformed",
                **{f"deep-{key}.png": f"'{key}' field is malformed" for key in ("adapters", "control", "image",
                                                                                 "mask")},
                "path-card.png": "'card' field is malformed",
                "lost-control.png": "gone.png, which is not there; give it with --control",
                "grid.png": "grid.png: records no request (a --grid of several images records none)"}
    _, report = run("generate", "tiny-base", "-p", "a bag", "-n", "2", "--steps", "1", "--grid", "--out",
                    tmp_path / "g")  # it was made again as an unconditional image of seed 0
    cases["grid.png"] = Path(report["grid"]).read_bytes()
    for name, data in cases.items():
        (tmp_path / name).write_bytes(data)
        result, report = run("generate", "--like", tmp_path / name, "--out", tmp_path / "x")
        assert result.exit_code == 2 and messages[name] in report["error"]["message"], (name, result.output)
    for args, message in ((["--like", tmp_path], "not a regular file"),
                          ([], "give a CARD to generate with (or --like IMAGE")):
        result, report = run("generate", *args, "--out", tmp_path / "x")
        assert result.exit_code == 2 and message in report["error"]["message"], result.output
    assert not (tmp_path / "x").exists()


def test_an_image_whose_card_is_off_the_search_path_says_to_give_its_folder(made, on_path, monkeypatch, tmp_path):
    """The PNG records its card's id only: made from a folder off the path, --like alone cannot find it again. The
    command it suggests names the image as given (from another folder, its name alone is no file), quoted."""
    monkeypatch.delenv("CARDTOOL_PATH")
    spaced = made.with_name("my image.png")
    made.rename(spaced)
    monkeypatch.chdir(tmp_path)
    given = spaced.relative_to(tmp_path)
    result, report = run("generate", "--like", given, "--out", tmp_path / "x")
    assert str(given) != spaced.name and result.exit_code == 2 and report["error"]["message"].startswith(
        f"my image.png was made by card 'tiny-base': give its folder as CARD (cardtool generate FOLDER --like "
        f"'{given}') — no card with id 'tiny-base'")
    made = spaced
    result, _ = run("generate", on_path / "tiny-base", "--like", made, "--out", tmp_path / "x")
    assert result.exit_code == 0, result.output


def test_unlike_names_what_differs_whatever_the_recorded_weights_hold(made):
    from cardtool.core.sampling.like import read_like, unlike

    like = read_like(made)
    assert unlike(like, like.metadata) == []
    for recorded, expected in (('[{"a": 1}]', ["weights"]), ("not json", ["weights"]),
                               ('{"vae": "0"}', ["weights of text_encoder, transformer, vae"]), (DEEP, ["weights"])):
        like.metadata["weights"] = recorded
        assert unlike(like, read_like(made).metadata) == expected


def test_unlike_tells_start_images_and_control_images_apart_by_content_and_preprocessor(made):
    """A start image or mask by its sha256 wherever its file was; a control image also by its preprocessor; a
    workflow chain's start image is its input, found beside it, so it is never named."""
    from cardtool.core.sampling.like import read_like, unlike

    like = read_like(made)
    record = {"sha256": "a" * 64, "source": "/x/a.png", "preprocessor": "edges"}
    for key in ("image", "mask", "control"):
        like.metadata[key] = json.dumps(record)
        assert unlike(like, {**like.metadata, key: json.dumps({**record, "source": "/y/b.png"})}) == []
        assert unlike(like, {**like.metadata, key: json.dumps({**record, "sha256": "b" * 64})}) == [key]
        assert unlike(like, {**like.metadata, key: json.dumps({**record, "preprocessor": "silhouette"})}) == (
            ["control"] if key == "control" else [])
    chain = {**like.metadata, "input": "draft/0", "platform": "cuda/sm90"}
    like.metadata = chain
    assert unlike(like, {**chain, "image": json.dumps({**record, "sha256": "b" * 64}), "platform": "cpu"}) == [
        "platform (cuda/sm90 there, cpu here)"]
    like.metadata = {**chain, "cardtool": "9" * 50}
    assert unlike(like, {**chain, "cardtool": None}) == [f"cardtool ({'9' * 39}… there, none recorded here)"]


def test_the_solver_precision_and_guidance_interval_of_an_image_are_made_again(on_path, tmp_path):
    result, report = run("generate", "tiny-base", "-p", "a coat", "--seed", "2", "--steps", "3", "--solver",
                         "dpmpp_2m", "--precision", "float64", "--guidance-interval", "0.2,0.8", "--out",
                         tmp_path / "a")
    assert result.exit_code == 0, result.output
    made = Path(report["images"][0]["path"])
    result, report = run("generate", "--like", made, "--out", tmp_path / "b")
    assert result.exit_code == 0, result.output
    again = Path(report["images"][0]["path"])
    assert again.read_bytes() == made.read_bytes()
    metadata = read_png_metadata(again)
    assert (metadata["solver"], metadata["precision"], metadata["guidance_interval"]) == ("dpmpp_2m", "float64",
                                                                                             "0.2,0.8")
