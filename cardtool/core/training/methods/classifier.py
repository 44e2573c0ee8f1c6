"""`--method classifier`: the Fashion-MNIST CNN that judges generated images (reward and FID features),
trained with cross-entropy, horizontal flips and small translations."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from cardtool.backends.cnn_config import FashionCNNConfig
from cardtool.backends.platform import Platform
from cardtool.backends.training import FashionCNN
from cardtool.core.data import Split
from cardtool.core.evaluation.reward import JUDGE_BATCH
from cardtool.core.training.methods.vae import to_unit
from cardtool.core.training.recipes import Recipe, only_keys
from cardtool.core.training.trainer import Task
from cardtool.errors import BadInput

__all__ = ["ClassifierTask"]


class ClassifierTask(Task):
    def __init__(self, recipe: Recipe, platform: Platform, train: Split, test: Split):
        only_keys(recipe, "loss", ())
        only_keys(recipe, "data", ("folder",))
        train, test = train.classes("a classifier"), test.classes("a classifier")
        self.device = platform.torch_device
        torch.manual_seed(recipe.train.seed)
        config = FashionCNNConfig.from_card(recipe.model, "fashion-cnn")
        top = int(max(train.labels.max(initial=0), test.labels.max(initial=0)))
        if top >= config.classes:  # cross-entropy's IndexError at the first batch holding such a label
            raise BadInput(f"model.classes is {config.classes}, but the data's labels go up to {top}: give at least "
                           f"{top + 1}")
        self.model = FashionCNN(**config.model_dump()).to(self.device)
        # uint8, converted a batch at a time (VAETask says why)
        self.images, self.labels = train.images, torch.from_numpy(train.labels)
        self.test_images, self.test_labels = test.images, torch.from_numpy(test.labels)

    def modules(self):
        return {"classifier": self.model}

    def dataset_size(self) -> int:
        return len(self.images)

    def loss(self, indices, generator):
        images = to_unit(self.images[indices])
        flip = torch.rand(len(indices), generator=generator) < 0.5
        images = torch.where(flip[:, None, None, None], images.flip(-1), images)
        shift = torch.randint(-2, 3, (2,), generator=generator)  # a small translation per batch
        images = torch.roll(images, shifts=(int(shift[0]), int(shift[1])), dims=(2, 3)).to(self.device)
        logits = self.model(images).float()
        labels = self.labels[indices].to(self.device)
        loss = F.cross_entropy(logits, labels)
        return loss, {"accuracy": float((logits.argmax(1) == labels).float().mean())}

    @torch.no_grad()
    def finish(self, model: FashionCNN) -> dict:
        n = JUDGE_BATCH
        predictions = torch.cat([model(to_unit(self.test_images[i:i + n]).to(self.device)).argmax(1).cpu()
                                 for i in range(0, len(self.test_images), n)])
        return {"test_accuracy": round(float((predictions == self.test_labels).float().mean()), 4)}
