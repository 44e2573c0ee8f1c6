"""Training on your own captioned images (an image folder with metadata.jsonl): reading it — any image format and
size, upright, grey, inside the folder —, each image conditioned on its own caption, and clear errors."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
from helpers import REPO
from PIL import Image
from typer.testing import CliRunner

from cardtool.cli import app
from cardtool.core.cards.loader import load_card
from cardtool.core.data import load_split
from cardtool.core.training.recipes import load_recipe
from cardtool.core.training.train import train
from cardtool.errors import BadInput

RECIPES = REPO / "examples" / "recipes"
CAPTIONS = ["a bright bag", "a dark bag with a strap", "a wide coat"]


def write_folder(root, count=20, rows=None):
    """`count` images — grey PNGs of 28 px, RGB PNGs of 56 px in a subfolder, RGBA PNGs — captioned in turn."""
    (root / "more").mkdir(parents=True, exist_ok=True)
    lines = []
    for i in range(count):
        value = 20 * i % 250
        if i % 3 == 0:
            name, image = f"g{i}.png", Image.fromarray(np.full((28, 28), value, np.uint8), "L")
        elif i % 3 == 1:
            name, image = f"more/c{i}.png", Image.fromarray(np.full((56, 56, 3), value, np.uint8), "RGB")
        else:
            rgba = np.zeros((28, 28, 4), np.uint8)
            rgba[..., :3], rgba[..., 3] = value, 255
            name, image = f"a{i}.png", Image.fromarray(rgba, "RGBA")
        image.save(root / name)
        lines.append({"file_name": name, "text": CAPTIONS[i % 3]})
    rows = lines if rows is None else rows(lines)
    (root / "metadata.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return root


def test_an_image_folder_reads_as_grey_squares_with_their_captions(tmp_path):
    root = write_folder(tmp_path / "mine")
    train, test = load_split("train", root), load_split("test", root)
    assert train.images.shape == (18, 28, 28) and test.images.shape == (2, 28, 28), "every tenth row held out"
    assert train.captions[:3] == tuple(CAPTIONS) and test.captions == (CAPTIONS[0], CAPTIONS[1])
    assert [int(i.mean()) for i in train.images[:3]] == [0, 20, 40], "grey, RGB resized, RGBA: each its value"
    assert (train.labels == -1).all() and train.digest() != load_split("train", write_folder(
        tmp_path / "other", rows=lambda rows: [{**r, "text": r["text"] + "!"} for r in rows])).digest()
    marked = write_folder(tmp_path / "marked", rows=lambda rows: [{**r, "split": "test"} if i < 3 else r
                                                                  for i, r in enumerate(rows)])
    assert len(load_split("test", marked)) == 3 and len(load_split("train", marked)) == 17


def test_metadata_written_on_windows_reads_as_the_same_rows(tmp_path):
    """A byte-order mark, CRLF line ends and blank lines (Notepad, PowerShell's Out-File) were refused at line 1."""
    plain = write_folder(tmp_path / "mine")
    text = (plain / "metadata.jsonl").read_text()
    windows = write_folder(tmp_path / "windows")
    (windows / "metadata.jsonl").write_bytes(("\ufeff" + text.replace("\n", "\r\n") + "\r\n").encode())
    for split in ("train", "test"):
        a, b = load_split(split, plain), load_split(split, windows)
        assert a.captions == b.captions and np.array_equal(a.images, b.images)


@pytest.mark.parametrize(("rows", "message"), [
    (lambda rows: [{**rows[0], "file_name": "../outside.png"}, *rows[1:]], "leads outside the folder"),
    (lambda rows: [{**rows[0], "file_name": "/etc/passwd"}, *rows[1:]], "leads outside the folder"),
    (lambda rows: [{**rows[0], "file_name": "missing.png"}, *rows[1:]], "line 1 of metadata.jsonl"),
    (lambda rows: [{**rows[0], "text": 3}, *rows[1:]], "metadata.jsonl:1: text must be the image's caption"),
    (lambda rows: [*rows[:2], {**rows[2], "split": "val"}, *rows[3:]], "metadata.jsonl:3: split must be"),
    (lambda rows: [*rows[:1], {**rows[1], "label": 3}, *rows[2:]], "metadata.jsonl:2: unknown key 'label'"),
    (lambda rows: [], "lists no images"),
    (lambda rows: rows[:5], "the test split holds no images"),
    (lambda rows: [[1, 2], *rows], "metadata.jsonl:1: not a JSON object"),
    (lambda rows: [*rows[:3], {**rows[3], "file_name": 7}, *rows[4:]], "metadata.jsonl:4: file_name must be the "),
    (lambda rows: [{**rows[0], "file_name": ""}, *rows[1:]], "metadata.jsonl:1: file_name must be the image's path"),
    (lambda rows: [{**rows[0], "file_name": "g0.png\0x"}, *rows[1:]], "metadata.jsonl:1: file_name must be the "),
    (lambda rows: [{"text": "a bag"}, *rows[1:]], "metadata.jsonl:1: file_name must be the image's path inside"),
    (lambda rows: rows[:1], r"the test split holds no images \(one image; with no"),
    (lambda rows: rows[:9], r"the test split holds no images \(9 images; with no"),
])
def test_a_bad_image_folder_is_a_located_error(tmp_path, rows, message):
    root = write_folder(tmp_path / "bad", rows=rows)
    with pytest.raises(BadInput, match=message):
        load_split("test", root)
        load_split("train", root)


def test_metadata_that_cannot_be_read_and_too_many_rows_are_refused(tmp_path, monkeypatch):
    from cardtool.core import image_folder

    root = write_folder(tmp_path / "mine")
    rows = (root / "metadata.jsonl").read_bytes()
    (root / "metadata.jsonl").write_bytes(b"\xff\xfe" + rows)
    with pytest.raises(BadInput, match="cannot read the image folder's captions: .*metadata.jsonl is not UTF-8"):
        load_split("train", root)
    (root / "metadata.jsonl").write_bytes(rows)
    monkeypatch.setattr(image_folder, "MAX_METADATA_BYTES", len(rows))
    assert len(load_split("train", root)) == 18
    monkeypatch.setattr(image_folder, "MAX_METADATA_BYTES", len(rows) - 1)
    with pytest.raises(BadInput, match=f"metadata.jsonl is larger than {len(rows) - 1} bytes"):
        load_split("train", root)
    monkeypatch.setattr(image_folder, "MAX_METADATA_BYTES", len(rows))
    monkeypatch.setattr(image_folder, "MAX_IMAGES", 20)
    assert len(load_split("test", root)) == 2
    monkeypatch.setattr(image_folder, "MAX_IMAGES", 19)
    with pytest.raises(BadInput, match="metadata.jsonl lists more than 19 images$"):
        load_split("train", root)


def test_a_long_bad_value_is_cut_in_its_message(tmp_path):
    root = write_folder(tmp_path / "long", rows=lambda rows: [{**rows[0], "text": ["x" * 1000]}, *rows[1:]])
    with pytest.raises(BadInput, match="text must be the image's caption") as caught:
        load_split("train", root)
    assert len(str(caught.value)) == 300


def test_a_link_out_of_the_folder_and_a_file_that_is_no_image_are_refused(tmp_path):
    root = write_folder(tmp_path / "linked")
    outside = tmp_path / "secret.png"
    Image.fromarray(np.zeros((28, 28), np.uint8)).save(outside)
    (root / "g0.png").unlink()
    os.symlink(outside, root / "g0.png")
    with pytest.raises(BadInput, match="'g0.png' leads outside the folder"):
        load_split("train", root)
    (root / "g0.png").unlink()
    (root / "g0.png").write_text("not an image")
    with pytest.raises(BadInput, match="cannot read training image .line 1 of metadata.jsonl."):
        load_split("train", root)
    (root / "metadata.jsonl").write_text('{"file_name": "g0.png", "text": "x"}\n{oops\n')
    with pytest.raises(BadInput, match="metadata.jsonl:2: not a JSON object"):
        load_split("train", root)


def test_each_image_trains_on_its_own_caption(examples, tmp_path):
    from cardtool.backends.platform import Platform
    from cardtool.core.training.methods.adapters import adapter_task

    root = write_folder(tmp_path / "mine")
    recipe = load_recipe(RECIPES / "fashion-bold.yaml", ["optim.steps=2", "optim.batch_size=4",
                                                          "train.precision=float32", "card.id=tiny-mine",
                                                          "model.rank=2", f"parents=[{examples / 'tiny-base'}]"])
    train_split, test_split = load_split("train", root), load_split("test", root)
    task = adapter_task(recipe, Platform.detect("cpu"), train_split, test_split)
    assert task.per_class == 1 and len(task.text) == len(CAPTIONS) + 1, "three distinct captions and the empty one"
    assert task.filled is None, "no caption reaches the encoder's 16 tokens"
    encoded = {c: task.text[i] for i, c in enumerate(CAPTIONS)}
    for i, caption in enumerate(train_split.captions):
        assert torch.equal(task.text[task.labels[i]], encoded[caption])
    card = train(recipe, command="c", out=tmp_path / "tiny-mine", run_dir=tmp_path / "run", data=str(root))
    data = load_card(card.folder).manifest.recipe.data
    assert data["dataset"] == "image-folder" and data["images"] == 18 and data["digest"] == train_split.digest()
    result = CliRunner().invoke(app, ["generate", str(card.folder), "-p", "a wide coat", "--steps", "2", "--out",
                                      str(tmp_path / "o"), "--json"])
    assert result.exit_code == 0, result.output


def test_a_caption_past_the_text_encoders_tokens_is_warned_of_before_training(examples, tmp_path):
    long = "a dark grey pullover with long sleeves and a round neck on a white background"
    root = write_folder(tmp_path / "mine", rows=lambda rows: [{**r, "text": long} if i % 4 == 0 or i % 10 == 9 else r
                                                               for i, r in enumerate(rows)])  # held out: 9, 19
    sets = ["optim.steps=1", "optim.batch_size=4", "train.precision=float32", "card.id=tiny-mine", "model.rank=2",
            f"parents=[{examples / 'tiny-base'}]"]
    result = CliRunner().invoke(app, ["train", "--recipe", str(RECIPES / "fashion-bold.yaml"), "--data", str(root),
                                      *(f"--set={o}" for o in sets), "--out", str(tmp_path / "card"), "--run-dir",
                                      str(tmp_path / "run"), "--json"])
    assert result.exit_code == 0, result.output
    warning = ("warning a caption fills all 16 tokens the text encoder reads (its max_length): words past them do not "
               f"reach the model — {long[:59] + '…'!r}; shorten it")
    assert warning in " ".join(result.stderr.split()), result.stderr
    assert result.stderr.index("warning") < result.stderr.index("step 1/"), "said before the run, not after it"
    judged = CliRunner().invoke(app, ["eval", str(tmp_path / "card"), "--judge", str(examples / "tiny-judge"),
                                      "--data", str(root), "--per-class", "1", "--steps", "1", "--json"])
    assert judged.exit_code == 0, judged.output
    assert warning.removeprefix("warning ") in json.loads(judged.stdout)["warnings"], "and of the captions eval samples"


def test_what_needs_classes_refuses_captioned_images(examples, tmp_path):
    root = write_folder(tmp_path / "mine")
    result = CliRunner().invoke(app, ["train", "--recipe", str(RECIPES / "fashion-classifier.yaml"), "--data",
                                      str(root), "--set", "optim.steps=1", "--out", str(tmp_path / "c"),
                                      "--run-dir", str(tmp_path / "r"), "--json"])
    assert result.exit_code == 2 and "a classifier needs class-labelled images" in result.stdout
    result = CliRunner().invoke(app, ["rl", str(examples / "tiny-base"), "--reward", str(examples / "tiny-judge"),
                                      "--watch-every", "1", "--judge", str(examples / "tiny-judge"),
                                      "--held-out-judge", "", "--no-eval", "--data",
                                      str(root), "--out", str(tmp_path / "w"), "--json"])
    assert result.exit_code == 2 and "--watch-every's class accuracy needs class-labelled" in result.stdout
    result = CliRunner().invoke(app, ["flywheel", str(examples / "tiny-base"), "--reward", str(examples / "tiny-judge"),
                                      "--data", str(root), "--out-dir", str(tmp_path / "cards"), "--run-dir",
                                      str(tmp_path / "run"), "--json"])  # its eval stage, found before two stages
    assert result.exit_code == 2 and "the flywheel's eval needs class-labelled images" in result.stdout
    assert not (tmp_path / "cards").exists() and not (tmp_path / "run").exists()
    result = CliRunner().invoke(app, ["flywheel", str(examples / "tiny-base"), "--reward", str(examples / "tiny-judge"),
                                      "--judge", str(examples / "tiny-judge"), "--held-out-judge", "",
                                      "--set", "distill.loss.gan=true", "--data", str(root), "--stop-after", "distill",
                                      "--out-dir", str(tmp_path / "cards"), "--run-dir", str(tmp_path / "run"),
                                      "--json"])
    assert result.exit_code == 2, result.output  # the distill stage's GAN term's real images, found before the rl's
    assert "loss.gan's real images by class needs class-labelled images" in result.stdout
    assert not (tmp_path / "cards").exists() and not (tmp_path / "run").exists()


def test_eval_on_captioned_images_measures_fid_against_their_test_images(examples, tmp_path):
    """One image per test caption, each at its own seed; FID, KID and the floors against the folder's test images;
    no class, so no accuracy or reward — and a comparison pairs the two cards' FIDs."""
    root = write_folder(tmp_path / "mine", count=60)  # 54 train, 6 test images
    args = ["eval", str(examples / "tiny-base"), "--judge", str(examples / "tiny-judge"), "--data", str(root),
            "--per-class", "1", "--steps", "2", "--json"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    [row] = report["rows"]
    assert report["prompts"] == "captions" and row["images"] == 6
    assert row["class_accuracy"] is None and row["mean_reward"] is None and row["accuracy_by_class"] is None
    assert row["fid_fmnist"] > 0 and row["kid"] is not None and set(report["floors"]) == {"train_vs_test",
                                                                                         "vae_reconstruction"}
    versus = CliRunner().invoke(app, [*args, "--versus", str(examples / "tiny-distilled")])
    assert versus.exit_code == 0, versus.output
    [difference] = json.loads(versus.stdout)["versus"]["differences"]
    assert difference["accuracy"] is None and difference["fid_fmnist"] == pytest.approx(
        json.loads(versus.stdout)["versus"]["rows"][0]["fid_fmnist"] - row["fid_fmnist"], abs=1e-3)
    text = CliRunner().invoke(app, args[:-1], env={"COLUMNS": "250"})
    assert text.exit_code == 0 and "one image per test caption" in text.stdout
    missed = CliRunner().invoke(app, [*args, "--expect", "class_accuracy>=0"])
    assert missed.exit_code == 1, "no accuracy measured: the expectation is missed, not met"
    one = write_folder(tmp_path / "one", count=10)  # 9 train, 1 test image: no covariance (was a LinAlgError)
    alone = CliRunner().invoke(app, [*args[:5], str(one), *args[6:]])
    assert alone.exit_code == 2 and json.loads(alone.stdout)["error"]["message"] == (
        f"the test split of {one} holds 1 image; FID and KID need at least two (an image folder holds out every "
        'tenth image, or the rows marked "split": "test")')


def test_requests_of_captions_each_have_their_own_seed(examples, tmp_path, monkeypatch):
    from cardtool.core.evaluation import evaluate as evaluating

    seen = []
    real = evaluating._measure_row

    def spy(report, referee, real_features, labels, count, ranks, p, loop, requests, *rest, **kwargs):
        seen.append([(r.prompt, r.seed) for r in requests])
        return real(report, referee, real_features, labels, count, ranks, p, loop, requests, *rest, **kwargs)

    monkeypatch.setattr(evaluating, "_measure_row", spy)
    root = write_folder(tmp_path / "mine", count=60)
    evaluating.evaluate(str(examples / "tiny-base"), judge=str(examples / "tiny-judge"), data=str(root), per_class=1,
                        steps=[2], seed=7)
    assert seen == [[(c, 7 + i) for i, c in enumerate(load_split("test", root).captions)]]


def test_a_resumed_eval_of_captioned_images_sees_an_image_changed_in_a_subfolder(examples, tmp_path):
    root = write_folder(tmp_path / "mine", count=60)
    args = ["eval", str(examples / "tiny-base"), "--judge", str(examples / "tiny-judge"), "--data", str(root),
            "--per-class", "1", "--steps", "2", "--out", str(tmp_path / "r.json"), "--json"]
    assert CliRunner().invoke(app, args).exit_code == 0
    again = CliRunner().invoke(app, [*args, "--resume"])
    assert again.exit_code == 0 and json.loads(again.stdout)["kept_rows"] == 1
    Image.fromarray(np.full((56, 56, 3), 255, np.uint8), "RGB").save(root / "more" / "c1.png")  # the same size
    changed = CliRunner().invoke(app, [*args, "--resume"])
    assert changed.exit_code == 2 and "measured with other data" in changed.stdout


@pytest.mark.parametrize("inside", ["", "bags"])
def test_a_folder_of_images_without_metadata_says_what_is_missing(tmp_path, inside):
    """It said the folder had no train-images-idx3-ubyte and to install Fashion-MNIST."""
    from cardtool.core.data import load_split

    (tmp_path / "mine" / inside).mkdir(parents=True, exist_ok=True)
    Image.fromarray(np.zeros((28, 28), np.uint8)).save(tmp_path / "mine" / inside / "red.PNG")
    with pytest.raises(BadInput, match=r"mine holds images but no metadata.jsonl, which captioned images need"):
        load_split("train", tmp_path / "mine")
    (tmp_path / "mine" / inside / "red.PNG").rename(tmp_path / "mine" / inside / "notes.txt")
    with pytest.raises(BadInput, match="has no train-images-idx3-ubyte"):
        load_split("train", tmp_path / "mine")


def test_a_data_folder_this_user_may_not_read_is_said_of_the_folder(tmp_path, monkeypatch):
    """It was said of the first file looked for in it ('d0/metadata.jsonl: Permission denied')."""
    import errno
    import re
    from pathlib import Path

    from cardtool.core.data import data_dir

    folder = tmp_path / "theirs"
    folder.mkdir()
    listing = os.scandir

    def private(path, *args):
        if Path(path) == folder:
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return listing(path, *args)

    monkeypatch.setattr(os, "scandir", private)
    with pytest.raises(BadInput, match=f"^the data folder {re.escape(str(folder))} cannot be read: Permission denied$"):
        data_dir(str(folder))
    assert data_dir(str(tmp_path)) == tmp_path
