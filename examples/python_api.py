"""cardtool from Python: load a card once, generate with and without an adapter and from an image, catch a
bad request.

    python examples/python_api.py [OUT_DIR]

Runs on the tiny example card in seconds (its weights are random, so the images are noise); swap in
`fashion-base` and its adapter card `fashion-adapters` for garments.
"""

import json
import sys
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
