"""A PyTorch Lightning ``training_step`` with manual optimization through ``functacc.jit``.

Lightning's "Manual optimization" guide trains a GAN in ``training_step``:
``g_opt, d_opt = self.optimizers()``, ``self.toggle_optimizer(d_opt)``,
``self.manual_backward(d_loss)``, ``d_opt.step()``, ``self.untoggle_optimizer(d_opt)``, the
same for the generator, and ``self.log_dict({"g_loss": ..., "d_loss": ...}, prog_bar=True)``.
Here the model jits its own ``training_step`` when training starts, with the trainer's
optimizers, and the ``Trainer`` runs it as it runs the eager one.

Before 2026-11-28 ``self.log_dict`` in the jitted step was a ``TraceError`` from inside
Lightning (its result metric made a torchmetrics state while traced). ``LightningModule.log``,
``log_dict`` and ``print`` called from the step are now noted and run after each call with
the call's values, as ``fabric.log`` is. With ``backend="eager"`` weights, the metrics logged
every step (a ``CSVLogger``) and the trainer's ``callback_metrics`` are compared bit for bit.
"""

from __future__ import annotations

import csv
import logging
import pathlib
import warnings

import pytest
import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import functacc


class GAN(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.G = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 2))
        self.D = nn.Sequential(nn.Linear(2, 32), nn.LeakyReLU(0.2), nn.Linear(32, 1))

    def training_step(self, batch: tuple, batch_idx: int) -> None:
        real, z = batch
        g_opt, d_opt = self.optimizers()
        fake = self.G(z)
        self.toggle_optimizer(d_opt)
        d_loss = F.softplus(-self.D(real)).mean() + F.softplus(self.D(fake.detach())).mean()
        d_opt.zero_grad()
        self.manual_backward(d_loss)
        d_opt.step()
        self.untoggle_optimizer(d_opt)
        self.toggle_optimizer(g_opt)
        g_loss = F.softplus(-self.D(self.G(z))).mean()
        g_opt.zero_grad()
        self.manual_backward(g_loss)
        g_opt.step()
        self.untoggle_optimizer(g_opt)
        self.log_dict({"g_loss": g_loss, "d_loss": d_loss}, prog_bar=True)

    def configure_optimizers(self) -> list:
        return [
            torch.optim.Adam(self.G.parameters(), lr=1e-3, betas=(0.5, 0.999)),
            torch.optim.Adam(self.D.parameters(), lr=1e-3, betas=(0.5, 0.999)),
        ]


class JittedGAN(GAN):
    backend = "eager"

    def on_train_start(self) -> None:
        self.training_step = functacc.jit(  # type: ignore[method-assign]
            self.training_step,
            modules=[self],
            optimizers=self.trainer.optimizers,
            backend=self.backend,
        )


class InductorGAN(JittedGAN):
    backend = "inductor"


def fit(cls: type, folder: pathlib.Path) -> tuple:
    torch.manual_seed(0)
    model = cls()
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(64, 2, generator=g), torch.randn(64, 8, generator=g))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Lightning's advice on workers and loggers
        logging.getLogger("pytorch_lightning").setLevel(logging.ERROR)
        trainer = pl.Trainer(
            max_epochs=2,
            accelerator="cpu",
            logger=pl.loggers.CSVLogger(folder, name="gan"),
            log_every_n_steps=1,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        trainer.fit(model, DataLoader(data, batch_size=16))
    (metrics,) = folder.glob("gan/*/metrics.csv")
    with open(metrics) as f:
        rows = list(csv.DictReader(f))
    return model, trainer.callback_metrics, rows


def test_manual_optimization_gan_with_log_dict_as_eager(tmp_path: pathlib.Path) -> None:
    model, metrics, rows = fit(JittedGAN, tmp_path / "jit")
    ref, ref_metrics, ref_rows = fit(GAN, tmp_path / "eager")
    assert model.training_step.num_traces == 2  # no .grad yet, then with it
    for (name, a), b in zip(model.state_dict().items(), ref.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    assert metrics.keys() == ref_metrics.keys() and len(rows) == len(ref_rows) == 8
    assert all(torch.equal(metrics[k], ref_metrics[k]) for k in metrics)
    assert rows == ref_rows  # every step's logged losses, as text


@pytest.mark.inductor
def test_manual_optimization_gan_with_log_dict_under_inductor(tmp_path: pathlib.Path) -> None:
    model, _, rows = fit(InductorGAN, tmp_path / "jit")
    ref, _, ref_rows = fit(GAN, tmp_path / "eager")
    # Inductor fuses and reorders float32 arithmetic: a few ulps per op, over 8 Adam steps
    # of two small models (a stale or missing log would be off by the loss itself).
    for a, b in zip(model.state_dict().values(), ref.state_dict().values(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    assert len(rows) == len(ref_rows) == 8
    for row, ref_row in zip(rows, ref_rows, strict=True):
        assert row.keys() == ref_row.keys() and row["step"] == ref_row["step"]
        for k in ("g_loss", "d_loss"):
            assert float(row[k]) == pytest.approx(float(ref_row[k]), rel=1e-5), (k, row)
