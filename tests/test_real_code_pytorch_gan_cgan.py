"""eriklindernoren/PyTorch-GAN's ``cgan.py`` (commit 36d3c77) through ``functacc.jit``,
against eager, with the loop body as written.

The noise and the generated labels are drawn with NumPy in the step
(``FloatTensor(np.random.normal(...))``, ``LongTensor(np.random.randint(...))``), and every
``sample_interval`` batches ``sample_image`` draws another grid of noise, builds its labels
with ``np.array`` and saves the generated images: the step's draws differ between the calls
that sample and the others, each program drawing its own before the graph, in the script's
order. The discriminator's dropout draws from torch's generator in the graph. The models are
the script's, narrower; MNIST is random images of 4x4 pixels.

Before 2026-11-29 the draws were a ``TraceError``; now the printed losses, the weights
(BatchNorm's running statistics included, which ``sample_image`` updates in training mode),
the PNG files and NumPy's generator are eager's, byte for byte (``backend="eager"``).
"""

from __future__ import annotations

import numpy as np
import torch
from pytorch_gan import eager_and_jit, images

SCRIPT = '''
import numpy as np
import torch
import torch.nn as nn
import types
from torch.autograd import Variable
from torchvision.utils import save_image

opt = types.SimpleNamespace(n_epochs=1, lr=0.0002, b1=0.5, b2=0.999, latent_dim=8, n_classes=10,
                            img_size=4, channels=1, sample_interval=3)
img_shape = (opt.channels, opt.img_size, opt.img_size)
cuda = False


class Generator(nn.Module):
    def __init__(self):
        super(Generator, self).__init__()

        self.label_emb = nn.Embedding(opt.n_classes, opt.n_classes)

        def block(in_feat, out_feat, normalize=True):
            layers = [nn.Linear(in_feat, out_feat)]
            if normalize:
                layers.append(nn.BatchNorm1d(out_feat, 0.8))
            layers.append(nn.LeakyReLU(0.2, inplace=True))
            return layers

        self.model = nn.Sequential(
            *block(opt.latent_dim + opt.n_classes, 32, normalize=False),
            *block(32, 64),
            nn.Linear(64, int(np.prod(img_shape))),
            nn.Tanh()
        )

    def forward(self, noise, labels):
        # Concatenate label embedding and image to produce input
        gen_input = torch.cat((self.label_emb(labels), noise), -1)
        img = self.model(gen_input)
        img = img.view(img.size(0), *img_shape)
        return img


class Discriminator(nn.Module):
    def __init__(self):
        super(Discriminator, self).__init__()

        self.label_embedding = nn.Embedding(opt.n_classes, opt.n_classes)

        self.model = nn.Sequential(
            nn.Linear(opt.n_classes + int(np.prod(img_shape)), 32),
            nn.LeakyReLU(0.2, inplace=True),
            nn.Linear(32, 32),
            nn.Dropout(0.4),
            nn.LeakyReLU(0.2, inplace=True),
            nn.Linear(32, 1),
        )

    def forward(self, img, labels):
        # Concatenate label embedding and image to produce input
        d_in = torch.cat((img.view(img.size(0), -1), self.label_embedding(labels)), -1)
        validity = self.model(d_in)
        return validity


adversarial_loss = torch.nn.MSELoss()
torch.manual_seed(0)
np.random.seed(0)
generator = Generator()
discriminator = Discriminator()
optimizer_G = torch.optim.Adam(generator.parameters(), lr=opt.lr, betas=(opt.b1, opt.b2))
optimizer_D = torch.optim.Adam(discriminator.parameters(), lr=opt.lr, betas=(opt.b1, opt.b2))
FloatTensor = torch.cuda.FloatTensor if cuda else torch.FloatTensor
LongTensor = torch.cuda.LongTensor if cuda else torch.LongTensor
dataloader = [None] * 6  # its length is read for the log line; the batches are passed in


def sample_image(n_row, batches_done):
    """Saves a grid of generated digits ranging from 0 to n_classes"""
    # Sample noise
    z = Variable(FloatTensor(np.random.normal(0, 1, (n_row ** 2, opt.latent_dim))))
    # Get labels ranging from 0 to n_classes for n rows
    labels = np.array([num for _ in range(n_row) for num in range(n_row)])
    labels = Variable(LongTensor(labels))
    gen_imgs = generator(z, labels)
    save_image(gen_imgs.data, "images/%d.png" % batches_done, nrow=n_row, normalize=True)


def iteration(epoch, i, imgs, labels):
    # the body of `for i, (imgs, labels) in enumerate(dataloader):`, as written
    batch_size = imgs.shape[0]

    # Adversarial ground truths
    valid = Variable(FloatTensor(batch_size, 1).fill_(1.0), requires_grad=False)
    fake = Variable(FloatTensor(batch_size, 1).fill_(0.0), requires_grad=False)

    # Configure input
    real_imgs = Variable(imgs.type(FloatTensor))
    labels = Variable(labels.type(LongTensor))

    optimizer_G.zero_grad()

    # Sample noise and labels as generator input
    z = Variable(FloatTensor(np.random.normal(0, 1, (batch_size, opt.latent_dim))))
    gen_labels = Variable(LongTensor(np.random.randint(0, opt.n_classes, batch_size)))

    # Generate a batch of images
    gen_imgs = generator(z, gen_labels)

    # Loss measures generator's ability to fool the discriminator
    validity = discriminator(gen_imgs, gen_labels)
    g_loss = adversarial_loss(validity, valid)

    g_loss.backward()
    optimizer_G.step()

    optimizer_D.zero_grad()

    # Loss for real images
    validity_real = discriminator(real_imgs, labels)
    d_real_loss = adversarial_loss(validity_real, valid)

    # Loss for fake images
    validity_fake = discriminator(gen_imgs.detach(), gen_labels)
    d_fake_loss = adversarial_loss(validity_fake, fake)

    # Total discriminator loss
    d_loss = (d_real_loss + d_fake_loss) / 2

    d_loss.backward()
    optimizer_D.step()

    print(
        "[Epoch %d/%d] [Batch %d/%d] [D loss: %f] [G loss: %f]"
        % (epoch, opt.n_epochs, i, len(dataloader), d_loss.item(), g_loss.item())
    )

    batches_done = epoch * len(dataloader) + i
    if batches_done % opt.sample_interval == 0:
        sample_image(n_row=10, batches_done=batches_done)
'''


def test_pytorch_gan_cgan_draws_its_noise_and_labels_as_in_eager(
    tmp_path, monkeypatch, capsys
) -> None:
    g = torch.Generator().manual_seed(1)
    batches = [
        (torch.rand(8, 1, 4, 4, generator=g) * 2 - 1, torch.randint(0, 10, (8,), generator=g))
        for _ in range(6)
    ]
    runs = eager_and_jit(
        SCRIPT, "cgan", tmp_path, monkeypatch, capsys, batches, lambda step, i, b: step(0, i, *b)
    )
    (eager, eager_out, eager_numpy, _), (ns, out, numpy_after, step) = runs["eager"], runs["jit"]
    assert out == eager_out and out.count("\n") == 6
    assert np.array_equal(numpy_after, eager_numpy)
    for name in ("generator", "discriminator"):
        expected = eager[name].state_dict()
        assert all(torch.equal(v, expected[k]) for k, v in ns[name].state_dict().items())
    saved = images(tmp_path / "jit" / "images")
    assert saved == images(tmp_path / "eager" / "images") and list(saved) == ["0.png", "3.png"]
    # the first call; its generator's grads (left by the call) now state; the calls that
    # do not sample, with their own draws
    assert step.num_traces == 3, [t.reason for t in step.traces]
