"""eriklindernoren/PyTorch-GAN's ``relativistic_gan.py`` (commit 36d3c77) through
``functacc.jit``, against eager, with the loop body as written.

The generator's half computes ``fake_pred = discriminator(gen_imgs)`` and a loss from it,
then overwrites that loss with ``adversarial_loss(discriminator(gen_imgs), valid)``: the
first forward's result is dropped, but in eager it still updates the discriminator's
BatchNorm running statistics and draws its Dropout2d masks. The script is the original but
for its arguments (a namespace, smaller sizes), its data (random 16x16 images passed in), its
device (the CPU) and the seeds; its loop body is ``iteration``.

Before 2026-11-28 functacc dropped that forward from the graph (``native_batch_norm``'s
schema does not mark the statistics it writes): the printed losses were eager's, the last
BatchNorm's running variance was not (0.21 where eager had 0.07), silently. Now the printed
lines, every weight and buffer, the PNG files and NumPy's generator are eager's, byte for
byte (``backend="eager"``).
"""

from __future__ import annotations

import numpy as np
import torch
from pytorch_gan import eager_and_jit, images

SCRIPT = """
import os
import types
import numpy as np
import math

import torchvision.transforms as transforms
from torchvision.utils import save_image

from torch.utils.data import DataLoader
from torchvision import datasets
from torch.autograd import Variable

import torch.nn as nn
import torch.nn.functional as F
import torch

os.makedirs("images", exist_ok=True)

opt = types.SimpleNamespace(n_epochs=1, batch_size=8, lr=0.0002, b1=0.5, b2=0.999, latent_dim=8,
                            img_size=16, channels=1, sample_interval=3, rel_avg_gan=False)

device = torch.device("cpu")


class Generator(nn.Module):
    def __init__(self):
        super(Generator, self).__init__()

        self.init_size = opt.img_size // 4
        self.l1 = nn.Sequential(nn.Linear(opt.latent_dim, 128 * self.init_size ** 2))

        self.conv_blocks = nn.Sequential(
            nn.BatchNorm2d(128),
            nn.Upsample(scale_factor=2),
            nn.Conv2d(128, 128, 3, stride=1, padding=1),
            nn.BatchNorm2d(128, 0.8),
            nn.LeakyReLU(0.2, inplace=True),
            nn.Upsample(scale_factor=2),
            nn.Conv2d(128, 64, 3, stride=1, padding=1),
            nn.BatchNorm2d(64, 0.8),
            nn.LeakyReLU(0.2, inplace=True),
            nn.Conv2d(64, opt.channels, 3, stride=1, padding=1),
            nn.Tanh(),
        )

    def forward(self, z):
        out = self.l1(z)
        out = out.view(out.shape[0], 128, self.init_size, self.init_size)
        img = self.conv_blocks(out)
        return img


class Discriminator(nn.Module):
    def __init__(self):
        super(Discriminator, self).__init__()

        def discriminator_block(in_filters, out_filters, bn=True):
            block = [nn.Conv2d(in_filters, out_filters, 3, 2, 1), nn.LeakyReLU(0.2, inplace=True), nn.Dropout2d(0.25)]
            if bn:
                block.append(nn.BatchNorm2d(out_filters, 0.8))
            return block

        self.model = nn.Sequential(
            *discriminator_block(opt.channels, 16, bn=False),
            *discriminator_block(16, 32),
            *discriminator_block(32, 64),
            *discriminator_block(64, 128),
        )

        # The height and width of downsampled image
        ds_size = opt.img_size // 2 ** 4
        self.adv_layer = nn.Sequential(nn.Linear(128 * ds_size ** 2, 1))

    def forward(self, img):
        out = self.model(img)
        out = out.view(out.shape[0], -1)
        validity = self.adv_layer(out)

        return validity


torch.manual_seed(0)
np.random.seed(0)

# Loss function
adversarial_loss = torch.nn.BCEWithLogitsLoss().to(device)

# Initialize generator and discriminator
generator = Generator().to(device)
discriminator = Discriminator().to(device)

# Configure data loader
dataloader = [None] * 5  # its length is read for the log line; the batches are passed in

# Optimizers
optimizer_G = torch.optim.Adam(generator.parameters(), lr=opt.lr, betas=(opt.b1, opt.b2))
optimizer_D = torch.optim.Adam(discriminator.parameters(), lr=opt.lr, betas=(opt.b1, opt.b2))

Tensor = torch.FloatTensor


def iteration(epoch, i, imgs):
    # the body of `for i, (imgs, _) in enumerate(dataloader):`, as written
    # Adversarial ground truths
    valid = Variable(Tensor(imgs.shape[0], 1).fill_(1.0), requires_grad=False)
    fake = Variable(Tensor(imgs.shape[0], 1).fill_(0.0), requires_grad=False)

    # Configure input
    real_imgs = Variable(imgs.type(Tensor))

    # -----------------
    #  Train Generator
    # -----------------

    optimizer_G.zero_grad()

    # Sample noise as generator input
    z = Variable(Tensor(np.random.normal(0, 1, (imgs.shape[0], opt.latent_dim))))

    # Generate a batch of images
    gen_imgs = generator(z)

    real_pred = discriminator(real_imgs).detach()
    fake_pred = discriminator(gen_imgs)

    if opt.rel_avg_gan:
        g_loss = adversarial_loss(fake_pred - real_pred.mean(0, keepdim=True), valid)
    else:
        g_loss = adversarial_loss(fake_pred - real_pred, valid)

    # Loss measures generator's ability to fool the discriminator
    g_loss = adversarial_loss(discriminator(gen_imgs), valid)

    g_loss.backward()
    optimizer_G.step()

    # ---------------------
    #  Train Discriminator
    # ---------------------

    optimizer_D.zero_grad()

    # Predict validity
    real_pred = discriminator(real_imgs)
    fake_pred = discriminator(gen_imgs.detach())

    if opt.rel_avg_gan:
        real_loss = adversarial_loss(real_pred - fake_pred.mean(0, keepdim=True), valid)
        fake_loss = adversarial_loss(fake_pred - real_pred.mean(0, keepdim=True), fake)
    else:
        real_loss = adversarial_loss(real_pred - fake_pred, valid)
        fake_loss = adversarial_loss(fake_pred - real_pred, fake)

    d_loss = (real_loss + fake_loss) / 2

    d_loss.backward()
    optimizer_D.step()

    print(
        "[Epoch %d/%d] [Batch %d/%d] [D loss: %f] [G loss: %f]"
        % (epoch, opt.n_epochs, i, len(dataloader), d_loss.item(), g_loss.item())
    )

    batches_done = epoch * len(dataloader) + i
    if batches_done % opt.sample_interval == 0:
        save_image(gen_imgs.data[:25], "images/%d.png" % batches_done, nrow=5, normalize=True)
"""  # noqa: E501 (the script's lines, as written)


def test_pytorch_gan_relativistic_gan_updates_batchnorm_in_its_dropped_forward_as_eager(
    tmp_path, monkeypatch, capsys
) -> None:
    g = torch.Generator().manual_seed(1)
    batches = [
        (torch.rand(8, 1, 16, 16, generator=g) * 2 - 1, torch.randint(0, 10, (8,), generator=g))
        for _ in range(5)
    ]
    runs = eager_and_jit(
        SCRIPT,
        "relativistic_gan",
        tmp_path,
        monkeypatch,
        capsys,
        batches,
        lambda step, i, b: step(0, i, b[0]),
    )
    (eager, eager_out, eager_numpy, _), (ns, out, numpy_after, _) = runs["eager"], runs["jit"]
    assert out == eager_out and out.count("\n") == 5
    assert np.array_equal(numpy_after, eager_numpy)
    for name in ("generator", "discriminator"):
        expected = eager[name].state_dict()
        assert all(torch.equal(v, expected[k]) for k, v in ns[name].state_dict().items())
    saved = images(tmp_path / "jit" / "images")
    assert saved == images(tmp_path / "eager" / "images") and list(saved) == ["0.png", "3.png"]
