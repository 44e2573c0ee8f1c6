"""`--method vae`: the conv VAE on Fashion-MNIST — reconstruction MSE plus a small KL term (Kingma &
Welling 2014), then the latent scaling factor (1/std of the training latents) and the test PSNR."""

from __future__ import annotations

import numpy as np
import torch

from cardtool.backends.conv_vae import ConvVAE
from cardtool.backends.platform import Platform
from cardtool.backends.vae_config import ConvVAEConfig
from cardtool.core.data import Split, unit_images
from cardtool.core.training.recipes import Recipe, loss_number, only_keys
from cardtool.core.training.trainer import Task
from cardtool.errors import BadInput, RunFailed

__all__ = ["VAETask", "to_unit", "psnr", "latents"]


def to_unit(images: np.ndarray) -> torch.Tensor:
    """uint8 (B, 28, 28) → float32 (B, 1, 28, 28) in [−1, 1] (data.unit_images) as a tensor."""
    return torch.from_numpy(unit_images(images))


# Images a VAE call encodes when a dataset is turned into latents: at 256 the widest activation is 16 MiB; at 1,000 it
# was 64 MiB, which glibc maps fresh and hands back on every call (Fashion-MNIST's 70,000 images: 11 million page
# faults; encoding 6,000 took 2.2 s at 1,000, 1.2 s at 256 on the 2-core Zen 5 EPYC)
ENCODE_BATCH = 256


@torch.no_grad()
def latents(vae, images: np.ndarray, device) -> tuple[torch.Tensor, torch.Tensor]:
    """The posterior mean and standard deviation of uint8 images as the denoise loop's latents (scaled by the VAE's
    scaling factor), (N, C, 1, H, W): one-frame videos, in batches of ENCODE_BATCH."""
    size = vae.config.image_size
    if images.shape[1:] != (size, size):
        raise BadInput(f"the VAE takes {size}×{size} images, the data are {images.shape[1]}×{images.shape[2]}")
    scale, means, stds = vae.config.scaling_factor, [], []
    for i in range(0, len(images), ENCODE_BATCH):
        mean, logvar = vae.encode(to_unit(images[i:i + ENCODE_BATCH]).to(device))
        means.append(mean * scale)
        stds.append((0.5 * logvar).exp() * scale)
    return torch.cat(means)[:, :, None], torch.cat(stds)[:, :, None]


def psnr(reconstruction: torch.Tensor, images: torch.Tensor) -> float:
    """PSNR in dB over [0, 1] pixels of images in [−1, 1], at most 100 dB: an exact reconstruction (blank images a
    decoder clamps to black) would be infinite, which a card's metrics cannot hold."""
    mse = ((reconstruction.clamp(-1, 1) - images) / 2).pow(2).mean().item()
    return float(10 * np.log10(1.0 / max(mse, 1e-10)))


class VAETask(Task):
    def __init__(self, recipe: Recipe, platform: Platform, train: Split, test: Split):
        self.recipe, self.device = recipe, platform.torch_device
        self.config = ConvVAEConfig.from_card(recipe.model)
        torch.manual_seed(recipe.train.seed)
        self.vae = ConvVAE(self.config).to(self.device)
        # kept as uint8 and converted a batch at a time: as float32 a dataset takes 4× its bytes (an IDX file may hold
        # 4 GB), and converting it whole took 12× at its peak
        self.images, self.test = train.images, test.images
        only_keys(recipe, "loss", ("kl_weight",))
        only_keys(recipe, "data", ("folder",))
        self.kl_weight = loss_number(recipe, "kl_weight", 1e-4, 0.0, float("inf"))

    def modules(self):
        return {"vae": self.vae}

    def loss_settings(self) -> dict[str, float]:
        return {"kl_weight": self.kl_weight}

    def dataset_size(self) -> int:
        return len(self.images)

    def loss(self, indices, generator):
        images = to_unit(self.images[indices]).to(self.device)
        reconstruction, mean, logvar = self.vae(images, generator=generator)
        mse = (reconstruction.float() - images).pow(2).mean()
        kl = 0.5 * (mean.float().pow(2) + logvar.float().exp() - 1 - logvar.float()).mean()
        return mse + self.kl_weight * kl, {"mse": float(mse.detach()), "kl": float(kl.detach())}

    @torch.no_grad()
    def finish(self, vae: ConvVAE) -> tuple[ConvVAEConfig, dict]:
        """The scaling factor from training latents, and reconstruction PSNR of the whole test split."""
        sample, n = self.images[:10000], ENCODE_BATCH
        means = torch.cat([vae.encode(to_unit(sample[i:i + n]).to(self.device))[0] for i in range(0, len(sample), n)])
        spread = float(means.std())
        if not spread >= 1e-6:  # the card's scaling factor (1/spread) is at most 1e6
            raise RunFailed(f"the VAE's latents have no spread (standard deviation {spread:.3g}), so there is no "
                            f"scaling factor to give the denoiser: its posterior collapsed — lower loss.kl_weight "
                            f"(now {self.kl_weight:g}) or train on images that differ")
        if not spread <= 1e6:  # and at least 1e-6 (1/spread)
            raise RunFailed(f"the VAE's latents spread with a standard deviation of {spread:.3g}, beyond the 1e6 a "
                            f"card's scaling factor (1/spread, at least 1e-6) can bring to unit spread: the KL term "
                            f"does not hold them — raise loss.kl_weight (now {self.kl_weight:g})")
        scale = float(f"{1.0 / spread:.8g}")  # significant digits: a small factor keeps its precision
        reconstructions = torch.cat([vae.decode(vae.encode(to_unit(self.test[i:i + n]).to(self.device))[0]).cpu()
                                     for i in range(0, len(self.test), n)])
        return self.config.model_copy(update={"scaling_factor": scale}), \
            {"test_psnr_db": round(psnr(reconstructions, to_unit(self.test)), 3), "scaling_factor": scale}
