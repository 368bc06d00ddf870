"""Hugging Face Accelerate's training loops through ``functacc.jit``, against eager.

The step bodies are those of accelerate's examples (``examples/by_feature/
gradient_accumulation.py``: ``with accelerator.accumulate(model):``, ``accelerator.backward``,
the prepared optimizer and scheduler stepped in the step; ``examples/cv_example.py`` with
clipping on the steps that sync), over the objects ``accelerator.prepare`` returns: an
``AcceleratedOptimizer`` wraps the optimizer, an ``AcceleratedScheduler`` the schedule, and
under ``mixed_precision="bf16"`` the model's forward runs under autocast.

Before 2026-11-28 ``jit(..., optimizers=[optimizer])`` of the prepared optimizer failed
with ``AttributeError: 'AcceleratedOptimizer' object has no attribute
'_optimizer_step_pre_hooks'``. With ``backend="eager"`` losses, weights, the learning rate
and the accelerator's step count are compared bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import accelerate
import pytest
import torch
import torch.nn.functional as F
import transformers
from test_real_code_hf import batches, glue_model
from torch import nn

import functacc


def fresh(**kwargs) -> accelerate.Accelerator:
    """An Accelerator as a new script makes it (its state is process-wide)."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    return accelerate.Accelerator(cpu=True, **kwargs)


def as_run(train_step: Callable, jit: str | None, modules: list, optimizer: Any) -> Any:
    """The step as the run takes it: eager's own function, or jitted on ``jit``'s backend."""
    if jit is None:
        return train_step
    return functacc.jit(train_step, modules=modules, optimizers=[optimizer], backend=jit)


def accumulation_run(jit: str | None, mixed_precision: str, steps: int) -> tuple:
    accelerator = fresh(mixed_precision=mixed_precision, gradient_accumulation_steps=steps)
    torch.manual_seed(0)
    model = glue_model()
    optimizer = torch.optim.AdamW(params=model.parameters(), lr=1e-3)
    lr_scheduler = transformers.get_linear_schedule_with_warmup(optimizer, 2, 10)
    model, optimizer, lr_scheduler = accelerator.prepare(model, optimizer, lr_scheduler)
    model.train()

    def train_step(batch: transformers.BatchEncoding) -> float:
        with accelerator.accumulate(model):
            output = model(**batch)
            loss = output.loss
            accelerator.backward(loss)
            optimizer.step()
            lr_scheduler.step()
            optimizer.zero_grad()
        return loss.item()

    step = as_run(train_step, jit, [model], optimizer)
    losses = [step(b) for b in batches()]
    weights = [p.detach().clone() for p in model.parameters()]
    traces = len(step.traces) if jit else 0
    return losses, weights, lr_scheduler.get_last_lr(), accelerator.step, traces


@pytest.mark.parametrize(("mixed_precision", "steps"), [("no", 2), ("no", 1), ("bf16", 2)])
def test_gradient_accumulation_example_matches_eager(mixed_precision: str, steps: int) -> None:
    eager = accumulation_run(None, mixed_precision, steps)
    jitted = accumulation_run("eager", mixed_precision, steps)
    assert jitted[0] == eager[0]
    assert all(torch.equal(a, b) for a, b in zip(jitted[1], eager[1], strict=True))
    assert jitted[2:4] == eager[2:4] and eager[3] == 6
    assert jitted[4] <= 2  # accumulating and syncing calls: one trace each


def cv_run(jit: str | None) -> tuple:
    accelerator = fresh(gradient_accumulation_steps=2)
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 36, 4)
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    lr_scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.1, total_steps=8)
    model, optimizer, lr_scheduler = accelerator.prepare(model, optimizer, lr_scheduler)
    mean = torch.tensor([0.5, 0.4, 0.3])[None, :, None, None]
    std = torch.tensor([0.2, 0.2, 0.3])[None, :, None, None]

    def train_step(batch: dict[str, torch.Tensor]) -> float:
        with accelerator.accumulate(model):
            inputs = (batch["image"] - mean) / std
            outputs = model(inputs)
            loss = F.cross_entropy(outputs, batch["label"])
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            lr_scheduler.step()
            optimizer.zero_grad()
        return loss.item()

    step = as_run(train_step, jit, [model], optimizer)
    g = torch.Generator().manual_seed(3)
    losses = []
    for _ in range(8):
        batch = {"image": torch.rand(4, 3, 8, 8, generator=g), "label": torch.arange(4) % 4}
        losses.append(step(batch))
    state = [t.detach().clone() for t in model.state_dict().values()]
    return losses, state, lr_scheduler.get_last_lr(), accelerator.step


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_cv_example_with_clipping_on_synced_steps_matches_eager(backend: str) -> None:
    eager, jitted = cv_run(None), cv_run(backend)
    assert jitted[2:] == eager[2:] and eager[3] == 8
    if backend == "eager":
        assert jitted[0] == eager[0]
        assert all(torch.equal(a, b) for a, b in zip(jitted[1], eager[1], strict=True))
    else:  # Inductor fuses the arithmetic: float32 rounding
        torch.testing.assert_close(jitted[0], eager[0], rtol=1e-4, atol=1e-5)
        for a, b in zip(jitted[1], eager[1], strict=True):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def tracking_run(jit: str | None, folder: str) -> tuple[list[float], list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accelerator = fresh(log_with="tensorboard", project_dir=folder)
    accelerator.init_trackers("run")
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = accelerator.prepare(model, optimizer)
    state = {"global_step": 0}

    def train_step(x: torch.Tensor, y: torch.Tensor) -> float:
        loss = F.mse_loss(model(x), y)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        state["global_step"] += 1
        logs = {"train_loss": loss.item(), "lr": optimizer.param_groups[0]["lr"]}
        accelerator.log(logs, step=state["global_step"])
        return loss.item()

    step = as_run(train_step, jit, [model], optimizer)
    g = torch.Generator().manual_seed(1)
    losses = [
        step(torch.randn(6, 4, generator=g), torch.randn(6, 2, generator=g)) for _ in range(4)
    ]
    accelerator.end_training()
    events = EventAccumulator(f"{folder}/run")
    events.Reload()
    return losses, [(e.step, e.value) for e in events.Scalars("train_loss")]


def test_accelerator_log_in_the_step_writes_eagers_points(tmp_path) -> None:
    # accelerator.log(...) reaches the trackers (here TensorBoard's) through accelerate's
    # code: before 2026-11-28 the jitted step logged no point at all, silently.
    eager = tracking_run(None, str(tmp_path / "eager"))
    jitted = tracking_run("eager", str(tmp_path / "jit"))
    assert jitted == eager and [s for s, _ in eager[1]] == [1, 2, 3, 4]


def diffusion_run(jit: str | None) -> tuple:
    # The training step of diffusers' examples/unconditional_image_generation/
    # train_unconditional.py: DDPM noise and timesteps drawn in the step, the scheduler's
    # add_noise (its alphas_cumprod a tensor kept on a plain object), a UNet2DModel, clipping
    # on syncing steps, and diffusers' EMAModel stepped over the parameters (a Python count
    # and a list of shadow tensors on a library object), with a small UNet.
    from diffusers import DDPMScheduler, UNet2DModel
    from diffusers.optimization import get_scheduler
    from diffusers.training_utils import EMAModel

    accelerator = fresh(gradient_accumulation_steps=1)
    torch.manual_seed(0)
    model = UNet2DModel(
        sample_size=8,
        layers_per_block=1,
        block_out_channels=(8, 16),
        down_block_types=("DownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "UpBlock2D"),
        norm_num_groups=4,
    )
    ema_model = EMAModel(model.parameters(), decay=0.9999, use_ema_warmup=True, power=0.75)
    noise_scheduler = DDPMScheduler(num_train_timesteps=100)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=1e-6)
    lr_scheduler = get_scheduler("cosine", optimizer, num_warmup_steps=2, num_training_steps=10)
    model, optimizer, lr_scheduler = accelerator.prepare(model, optimizer, lr_scheduler)
    state = {"global_step": 0}

    def train_step(clean_images: torch.Tensor) -> dict:
        noise = torch.randn(clean_images.shape, dtype=clean_images.dtype)
        bsz = clean_images.shape[0]
        timesteps = torch.randint(0, noise_scheduler.config.num_train_timesteps, (bsz,)).long()
        noisy_images = noise_scheduler.add_noise(clean_images, noise, timesteps)
        with accelerator.accumulate(model):
            model_output = model(noisy_images, timesteps).sample
            loss = F.mse_loss(model_output.float(), noise.float())
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            lr_scheduler.step()
            optimizer.zero_grad()
        if accelerator.sync_gradients:
            ema_model.step(model.parameters())
            state["global_step"] += 1
        logs = {"loss": loss.detach().item(), "lr": lr_scheduler.get_last_lr()[0]}
        logs["step"], logs["ema_decay"] = state["global_step"], ema_model.cur_decay_value
        return logs

    step = as_run(train_step, jit, [model], optimizer)
    g = torch.Generator().manual_seed(1)
    logs = [step(torch.rand(2, 3, 8, 8, generator=g) * 2 - 1) for _ in range(5)]
    weights = [p.detach().clone() for p in [*model.parameters(), *ema_model.shadow_params]]
    return logs, weights, ema_model.optimization_step, len(step.traces) if jit else 0


def test_diffusers_unconditional_training_step_matches_eager() -> None:
    # Before 2026-11-28: "its Python state kept changing shape" (each of the EMA's 114
    # shadow tensors was found by a trace of its own, past the limit of 16).
    eager, jitted = diffusion_run(None), diffusion_run("eager")
    assert jitted[0] == eager[0] and jitted[2] == eager[2] == 5
    assert all(torch.equal(a, b) for a, b in zip(jitted[1], eager[1], strict=True))
    assert jitted[3] <= 2  # the EMA's warm-up branch (decay 0 at its first step), then one


def dataloader_run(jit: str | None) -> tuple[list[tuple[float, bool]], list[torch.Tensor]]:
    from torch.utils.data import DataLoader, TensorDataset

    accelerator = fresh(gradient_accumulation_steps=3)
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(20, 4, generator=g), torch.randn(20, 2, generator=g))
    loader = DataLoader(data, batch_size=4)  # 5 batches: the last accumulation is cut short
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)

    def train_step(x: torch.Tensor, y: torch.Tensor) -> tuple[float, bool]:
        with accelerator.accumulate(model):
            loss = F.mse_loss(model(x), y)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        return loss.item(), accelerator.sync_gradients

    step = as_run(train_step, jit, [model], optimizer)
    out = [step(x, y) for _ in range(2) for x, y in loader]
    return out, [p.detach().clone() for p in model.parameters()]


def test_accumulation_syncs_at_the_end_of_a_prepared_dataloader_as_in_eager() -> None:
    # accelerate syncs the gradients on every 3rd batch and at the end of the prepared
    # dataloader (GradientState.end_of_dataloader, set by its iteration outside the step).
    eager, jitted = dataloader_run(None), dataloader_run("eager")
    assert jitted[0] == eager[0]
    assert [s for _, s in eager[0]] == [False, False, True, False, True] * 2
    assert all(torch.equal(a, b) for a, b in zip(jitted[1], eager[1], strict=True))


def text_to_image_run(jit: str | None) -> tuple[list[float], list[torch.Tensor], float]:
    # The training step of diffusers' examples/text_to_image/train_text_to_image.py: a
    # frozen VAE encodes the images to latents, a frozen CLIP text encoder the captions, a
    # UNet2DConditionModel predicts the noise, the loss is gathered and summed into
    # train_loss with .item(), clipped on syncing steps; small configs, random weights.
    from diffusers import AutoencoderKL, DDPMScheduler, UNet2DConditionModel

    accelerator = fresh(gradient_accumulation_steps=1)
    torch.manual_seed(0)
    vae = AutoencoderKL(
        block_out_channels=(8,),
        down_block_types=("DownEncoderBlock2D",),
        up_block_types=("UpDecoderBlock2D",),
        norm_num_groups=4,
        sample_size=8,
    )
    text_config = transformers.CLIPTextConfig(
        hidden_size=16,
        intermediate_size=32,
        num_attention_heads=2,
        num_hidden_layers=1,
        vocab_size=50,
        max_position_embeddings=8,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=1,
    )
    text_encoder = transformers.CLIPTextModel(text_config)
    unet = UNet2DConditionModel(
        sample_size=8,
        layers_per_block=1,
        block_out_channels=(8, 16),
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=16,
        norm_num_groups=4,
        attention_head_dim=2,
    )
    vae.requires_grad_(False)
    text_encoder.requires_grad_(False)
    noise_scheduler = DDPMScheduler(num_train_timesteps=100)
    optimizer = torch.optim.AdamW(unet.parameters(), lr=1e-4)
    unet, optimizer = accelerator.prepare(unet, optimizer)
    state = {"train_loss": 0.0}

    def train_step(pixel_values: torch.Tensor, input_ids: torch.Tensor) -> float:
        with accelerator.accumulate(unet):
            latents = vae.encode(pixel_values).latent_dist.sample() * vae.config.scaling_factor
            noise = torch.randn_like(latents)
            bsz = latents.shape[0]
            timesteps = torch.randint(0, noise_scheduler.config.num_train_timesteps, (bsz,))
            noisy_latents = noise_scheduler.add_noise(latents, noise, timesteps.long())
            encoder_hidden_states = text_encoder(input_ids, return_dict=False)[0]
            if noise_scheduler.config.prediction_type == "epsilon":
                target = noise
            else:
                target = noise_scheduler.get_velocity(latents, noise, timesteps)
            pred = unet(noisy_latents, timesteps, encoder_hidden_states, return_dict=False)[0]
            loss = F.mse_loss(pred.float(), target.float(), reduction="mean")
            avg_loss = accelerator.gather(loss.repeat(bsz)).mean()
            state["train_loss"] += avg_loss.item() / accelerator.gradient_accumulation_steps
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(unet.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad()
        return loss.item()

    step = as_run(train_step, jit, [unet, vae, text_encoder], optimizer)
    g = torch.Generator().manual_seed(1)
    losses = [
        step(torch.rand(2, 3, 8, 8, generator=g) * 2 - 1, torch.randint(0, 50, (2, 8), generator=g))
        for _ in range(3)
    ]
    return losses, [p.detach().clone() for p in unet.parameters()], state["train_loss"]


def test_diffusers_text_to_image_training_step_matches_eager() -> None:
    eager, jitted = text_to_image_run(None), text_to_image_run("eager")
    assert jitted[0] == eager[0] and jitted[2] == eager[2]
    assert all(torch.equal(a, b) for a, b in zip(jitted[1], eager[1], strict=True))
