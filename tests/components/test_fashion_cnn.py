"""The judge's classifier has a numpy reference forward over the same state dict (invariant 4): its features (what
FID is computed on) and logits match the torch module's in float64, in eval mode (dropout off)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cardtool.backends.cnn_config import FashionCNNConfig
from cardtool.backends.numpy_fashion_cnn import NumpyFashionCNN
from cardtool.backends.training import FashionCNN

torch.set_num_threads(1)


@pytest.mark.parametrize("settings", [{}, {"width": 16, "features": 12, "classes": 7, "dropout": 0.5}])
def test_numpy_features_and_logits_match_torch_in_float64(settings):
    torch.manual_seed(0)
    config = FashionCNNConfig(**settings)
    model = FashionCNN(**config.model_dump()).double().eval()
    reference = NumpyFashionCNN(config, {k: v.numpy() for k, v in model.state_dict().items()})
    images = torch.rand(3, 1, 28, 28, dtype=torch.float64) * 2 - 1
    with torch.no_grad():
        features, logits = model.embed(images), model(images)
    assert features.shape == (3, config.features) and logits.shape == (3, config.classes)
    np.testing.assert_allclose(reference.embed(images.numpy()), features.numpy(), atol=1e-12, rtol=1e-10)
    np.testing.assert_allclose(reference(images.numpy()), logits.numpy(), atol=1e-12, rtol=1e-10)
    np.testing.assert_allclose(reference.head(features.numpy()), logits.numpy(), atol=1e-12, rtol=1e-10)
    assert reference.embed(np.zeros((0, 1, 28, 28))).shape == (0, config.features)
