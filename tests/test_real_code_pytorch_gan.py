"""eriklindernoren/PyTorch-GAN's ``wgan_gp.py`` (commit 36d3c77) through ``functacc.jit``,
against eager.

The script's loop body is the step, as written: the legacy ``Tensor = torch.FloatTensor``
constructors (``Tensor(n, 1).fill_(1.0)``), ``Variable``, the noise and the interpolation
weights drawn with ``np.random``, the gradient penalty by ``autograd.grad(create_graph=True)``,
the generator trained every ``n_critic`` batches, the losses printed with ``%``, and
samples saved with ``save_image(fake_imgs.data[:25], "images/%d.png" % batches_done, ...)``
(imported as ``from torchvision.utils import save_image``) every ``sample_interval``
batches. The models are the script's, narrower; MNIST is random images of 4x4 pixels.

Before 2026-11-28 ``save_image`` in the step failed inside PIL on the traced array. It is
now noted and run after each call with the call's images, under whichever name the script
imported it. Before 2026-11-29 the ``np.random`` draws were a ``TraceError`` advising to draw
them before the call and pass them in: the loop had to be edited. Now each call draws them
again before the graph, in the script's order, from NumPy's global generator: the printed
losses, the weights, the PNG files and NumPy's generator are eager's, byte for byte
(``backend="eager"``), with the script as written.
"""

from __future__ import annotations

import os

import numpy as np
import torch

import functacc

SCRIPT = '''
import numpy as np
import torch
import torch.autograd as autograd
import torch.nn as nn
from torch.autograd import Variable
from torchvision.utils import save_image
import types

opt = types.SimpleNamespace(latent_dim=8, img_size=4, channels=1, n_critic=2, sample_interval=4,
                            lr=0.0002, b1=0.5, b2=0.999, n_epochs=1)
img_shape = (opt.channels, opt.img_size, opt.img_size)
cuda = False


class Generator(nn.Module):
    def __init__(self):
        super(Generator, self).__init__()

        def block(in_feat, out_feat, normalize=True):
            layers = [nn.Linear(in_feat, out_feat)]
            if normalize:
                layers.append(nn.BatchNorm1d(out_feat, 0.8))
            layers.append(nn.LeakyReLU(0.2, inplace=True))
            return layers

        self.model = nn.Sequential(
            *block(opt.latent_dim, 32, normalize=False),
            *block(32, 64),
            nn.Linear(64, int(np.prod(img_shape))),
            nn.Tanh()
        )

    def forward(self, z):
        img = self.model(z)
        img = img.view(img.shape[0], *img_shape)
        return img


class Discriminator(nn.Module):
    def __init__(self):
        super(Discriminator, self).__init__()
        self.model = nn.Sequential(
            nn.Linear(int(np.prod(img_shape)), 32),
            nn.LeakyReLU(0.2, inplace=True),
            nn.Linear(32, 1),
        )

    def forward(self, img):
        img_flat = img.view(img.shape[0], -1)
        validity = self.model(img_flat)
        return validity


lambda_gp = 10
torch.manual_seed(0)
np.random.seed(0)
generator = Generator()
discriminator = Discriminator()
optimizer_G = torch.optim.Adam(generator.parameters(), lr=opt.lr, betas=(opt.b1, opt.b2))
optimizer_D = torch.optim.Adam(discriminator.parameters(), lr=opt.lr, betas=(opt.b1, opt.b2))
Tensor = torch.cuda.FloatTensor if cuda else torch.FloatTensor


def compute_gradient_penalty(D, real_samples, fake_samples):
    """Calculates the gradient penalty loss for WGAN GP"""
    # Random weight term for interpolation between real and fake samples
    alpha = Tensor(np.random.random((real_samples.size(0), 1, 1, 1)))
    interpolates = (alpha * real_samples + ((1 - alpha) * fake_samples)).requires_grad_(True)
    d_interpolates = D(interpolates)
    fake = Variable(Tensor(real_samples.shape[0], 1).fill_(1.0), requires_grad=False)
    gradients = autograd.grad(
        outputs=d_interpolates,
        inputs=interpolates,
        grad_outputs=fake,
        create_graph=True,
        retain_graph=True,
        only_inputs=True,
    )[0]
    gradients = gradients.view(gradients.size(0), -1)
    gradient_penalty = ((gradients.norm(2, dim=1) - 1) ** 2).mean()
    return gradient_penalty


batches_done = 0


def iteration(epoch, i, imgs):
    # the body of `for i, (imgs, _) in enumerate(dataloader):`
    global batches_done
    real_imgs = Variable(imgs.type(Tensor))
    optimizer_D.zero_grad()
    z = Variable(Tensor(np.random.normal(0, 1, (imgs.shape[0], opt.latent_dim))))
    fake_imgs = generator(z)
    real_validity = discriminator(real_imgs)
    fake_validity = discriminator(fake_imgs)
    gradient_penalty = compute_gradient_penalty(
        discriminator, real_imgs.data, fake_imgs.data)
    d_loss = -torch.mean(real_validity) + torch.mean(fake_validity) + lambda_gp * gradient_penalty
    d_loss.backward()
    optimizer_D.step()
    optimizer_G.zero_grad()
    if i % opt.n_critic == 0:
        fake_imgs = generator(z)
        fake_validity = discriminator(fake_imgs)
        g_loss = -torch.mean(fake_validity)
        g_loss.backward()
        optimizer_G.step()
        print(
            "[Epoch %d/%d] [Batch %d/%d] [D loss: %f] [G loss: %f]"
            % (epoch, opt.n_epochs, i, 6, d_loss.item(), g_loss.item())
        )
        if batches_done % opt.sample_interval == 0:
            save_image(fake_imgs.data[:25], "images/%d.png" % batches_done, nrow=5, normalize=True)
        batches_done += opt.n_critic
'''


def script(folder: str) -> dict:
    """The script run as ``python wgan_gp.py`` would, from a file in ``folder``."""
    path = os.path.join(folder, "wgan_gp.py")
    with open(path, "w") as f:
        f.write(SCRIPT)
    namespace = {"__name__": "wgan_gp"}
    exec(compile(SCRIPT, path, "exec"), namespace)
    return namespace


def images(folder: str) -> dict[str, bytes]:
    names = sorted(os.listdir(folder))
    return {n: open(os.path.join(folder, n), "rb").read() for n in names}


def test_pytorch_gan_wgan_gp_trains_and_saves_its_samples_as_in_eager(
    tmp_path, monkeypatch, capsys
) -> None:
    g = torch.Generator().manual_seed(1)
    batches = [torch.rand(6, 1, 4, 4, generator=g) * 2 - 1 for _ in range(6)]
    for run in ("eager", "jit"):
        (tmp_path / run / "images").mkdir(parents=True)
    monkeypatch.chdir(tmp_path / "eager")
    eager = script(str(tmp_path / "eager"))
    capsys.readouterr()
    for i, imgs in enumerate(batches):
        eager["iteration"](0, i, imgs)
    eager_out = capsys.readouterr().out
    eager_numpy = np.random.get_state()[1].copy()  # where the draws left NumPy's generator

    monkeypatch.chdir(tmp_path / "jit")
    ns = script(str(tmp_path / "jit"))
    modules, optimizers = (
        [ns["generator"], ns["discriminator"]],
        [ns["optimizer_D"], ns["optimizer_G"]],
    )
    step = functacc.jit(ns["iteration"], modules=modules, optimizers=optimizers, backend="eager")
    capsys.readouterr()
    for i, imgs in enumerate(batches):
        step(0, i, imgs)
    assert capsys.readouterr().out == eager_out and eager_out.count("\n") == 3
    assert (np.random.get_state()[1] == eager_numpy).all()
    for name in ("generator", "discriminator"):
        expected = eager[name].state_dict()
        assert all(torch.equal(v, expected[k]) for k, v in ns[name].state_dict().items())
    assert ns["batches_done"] == eager["batches_done"] == 6
    saved = images(str(tmp_path / "jit" / "images"))
    assert saved == images(str(tmp_path / "eager" / "images")) and list(saved) == ["0.png", "4.png"]
    assert step.num_traces == 4  # D and G, D alone, grads of G dropped, the sampling branch
