"""cardtool from Python: load a card once, generate with and without an adapter and from an image, catch a
bad request, distil the card into a one-step student, sample it and check it against the numpy reference.

    python examples/python_api.py [OUT_DIR]

Runs on the tiny example card in seconds (its weights are random, so the images are noise); swap in
`fashion-base` and its adapter card `fashion-adapters` for garments.
"""

import json
import sys
import tempfile
from pathlib import Path

import cardtool

out = Path(sys.argv[1] if len(sys.argv) > 1 else "outputs/python-api")
card = cardtool.LoadedCard(str(Path(__file__).parent / "cards" / "tiny-base"))  # loaded once for every call below

plain = card.generate(["a sneaker", "a bag"], num=2, steps=4, out=out / "plain")
inverted = card.generate("a sneaker", num=2, steps=4, adapters=[("invert", 0.5)], out=out / "invert")
for image in plain.images + inverted.images:
    record = {"path": str(image.path), "prompt": image.metadata["prompt"], "seed": image.metadata["seed"],
              "adapters": json.loads(image.metadata.get("adapters", "[]"))}
    print(json.dumps(record))

# image-to-image from the first sneaker's pixels, kept in memory (out=None writes nothing)
refined = card.generate("a bag", steps=4, image=plain.images[0].pixels, strength=0.6, out=None).images[0]
print(json.dumps({"from_image": refined.metadata["strength"], "shape": list(refined.pixels.shape)}))

try:
    card.generate("a bag", adapters=[("no-such-adapter", 1.0)], out=out / "never")
except cardtool.BadInput as error:  # what the command line reports with exit 2
    print(f"refused: {error}")

# post-training is a call too: DMD2 into a 1-step student (one real iteration here), the card it wrote returned
steps = []
with tempfile.TemporaryDirectory() as run_dir:  # its checkpoints: a scratch run, made afresh on each run of this file
    student = cardtool.distill(card.card.folder, steps=1, overrides=["optim.steps=1"], evaluate=False,
                               out=out / "student", run_dir=run_dir, force=True, on_log=steps.append)
sampled = cardtool.LoadedCard(str(student.folder)).generate("a bag", out=None).images[0]
print(json.dumps({"student": student.id, "steps": sampled.metadata["steps"], "logged": len(steps),
                  "command": student.manifest.recipe.command}))

# a CI gate: the student's components, generation and promised consistency against numpy on this machine
report = cardtool.parity(student.folder, op="cfg_combine")
print(json.dumps({"parity": report.ok, "checked": sorted({row.cell.split("/")[0] for row in report.rows})}))
