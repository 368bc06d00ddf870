"""karpathy/nanoGPT's ``train.py`` loop (commit 3adf61e) through ``functacc.jit``, against eager.

``train.py`` is a script: its loop body reads and writes the script's globals (``iter_num``,
``local_iter_num``, ``running_mfu``, ``t0``, the prefetched ``X, Y``), sets each param
group's ``lr`` from ``get_lr(iter_num)`` (warm-up, cosine, floor), accumulates over micro
steps with a ``GradScaler`` (disabled unless float16), clips, steps, zeroes with
``set_to_none=True`` and prints ``loss.item()`` with the time and an MFU estimate. Its
``get_batch`` reads the token file as an ``np.memmap`` at positions from ``torch.randint``.
The model below is nanoGPT's GPT made small (tied embedding, ``scaled_dot_product_attention``
with ``is_causal=True``, ``configure_optimizers``' decay groups); the data a random token
file in a temporary folder.

Jitted as written, the body draws its batches in the step: before 2026-11-29 the error
named ``memmap.__getitem__`` as "code of numpy for between steps" and advised to call it
after each call, which cannot feed the step. It now names the array and the line, and the
statement to run before the call instead. With that done (the batches passed in, drawn in
eager's order), losses, the learning rate, the script's counters and the weights are
compared bit for bit on the eager backend.
"""

from __future__ import annotations

import logging
import os
import re

import pytest
import torch

import functacc

SCRIPT = """
import inspect, math, os, time
from contextlib import nullcontext

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd, n_head):
        super().__init__()
        self.c_attn = nn.Linear(n_embd, 3 * n_embd, bias=False)
        self.c_proj = nn.Linear(n_embd, n_embd, bias=False)
        self.n_head, self.n_embd = n_head, n_embd

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=None, dropout_p=0, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.c_proj(y)


class Block(nn.Module):
    def __init__(self, n_embd, n_head):
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(n_embd), nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU(),
                                 nn.Linear(4 * n_embd, n_embd))

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, vocab_size, block_size, n_layer, n_head, n_embd):
        super().__init__()
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(vocab_size, n_embd),
            wpe=nn.Embedding(block_size, n_embd),
            h=nn.ModuleList([Block(n_embd, n_head) for _ in range(n_layer)]),
            ln_f=nn.LayerNorm(n_embd),
        ))
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight
        self.n_layer, self.n_head, self.n_embd = n_layer, n_head, n_embd
        self.block_size = block_size

    def forward(self, idx, targets=None):
        b, t = idx.size()
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        for block in self.transformer.h:
            x = block(x)
        x = self.transformer.ln_f(x)
        logits = self.lm_head(x)
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        return logits, loss

    def configure_optimizers(self, weight_decay, learning_rate, betas, device_type):
        param_dict = {pn: p for pn, p in self.named_parameters() if p.requires_grad}
        decay_params = [p for n, p in param_dict.items() if p.dim() >= 2]
        nodecay_params = [p for n, p in param_dict.items() if p.dim() < 2]
        optim_groups = [
            {'params': decay_params, 'weight_decay': weight_decay},
            {'params': nodecay_params, 'weight_decay': 0.0}
        ]
        fused_available = 'fused' in inspect.signature(torch.optim.AdamW).parameters
        use_fused = fused_available and device_type == 'cuda'
        extra_args = dict(fused=True) if use_fused else dict()
        return torch.optim.AdamW(optim_groups, lr=learning_rate, betas=betas, **extra_args)

    def estimate_mfu(self, fwdbwd_per_iter, dt):
        N = sum(p.numel() for p in self.parameters())
        L, H, Q, T = self.n_layer, self.n_head, self.n_embd//self.n_head, self.block_size
        flops_per_token = 6*N + 12*L*H*Q*T
        flops_per_iter = flops_per_token * T * fwdbwd_per_iter
        return (flops_per_iter * (1.0/dt)) / 312e12


batch_size, block_size, gradient_accumulation_steps = 4, 16, 2
learning_rate, min_lr, warmup_iters, lr_decay_iters, decay_lr = 1e-3, 1e-4, 3, 6, True
grad_clip, log_interval, dtype, device, device_type = 1.0, 1, 'float32', 'cpu', 'cpu'
ctx = nullcontext() if device_type == 'cpu' else torch.amp.autocast(device_type=device_type)


def get_batch(split):
    data = np.memmap(os.path.join(data_dir, 'train.bin'), dtype=np.uint16, mode='r')
    ix = torch.randint(len(data) - block_size, (batch_size,))
    x = torch.stack([torch.from_numpy((data[i:i+block_size]).astype(np.int64)) for i in ix])
    y = torch.stack([torch.from_numpy((data[i+1:i+1+block_size]).astype(np.int64)) for i in ix])
    x, y = x.to(device), y.to(device)
    return x, y


def get_lr(it):
    if it < warmup_iters:
        return learning_rate * (it + 1) / (warmup_iters + 1)
    if it > lr_decay_iters:
        return min_lr
    decay_ratio = (it - warmup_iters) / (lr_decay_iters - warmup_iters)
    assert 0 <= decay_ratio <= 1
    coeff = 0.5 * (1.0 + math.cos(math.pi * decay_ratio))
    return min_lr + coeff * (learning_rate - min_lr)


torch.manual_seed(1337)
model = GPT(vocab_size=65, block_size=block_size, n_layer=2, n_head=2, n_embd=32)
scaler = torch.amp.GradScaler(device_type, enabled=(dtype == 'float16'))
optimizer = model.configure_optimizers(0.1, learning_rate, (0.9, 0.95), device_type)
iter_num, local_iter_num, running_mfu = 0, 0, -1.0
X, Y = get_batch('train')
t0 = time.time()


def iteration(*batches):
    # train.py's loop body from "determine and set the learning rate" to
    # `local_iter_num += 1`: with no arguments as written; else the micro steps take the
    # batches given instead of drawing the next one (the error's advice)
    global X, Y, t0, iter_num, local_iter_num, running_mfu
    lr = get_lr(iter_num) if decay_lr else learning_rate
    for param_group in optimizer.param_groups:
        param_group['lr'] = lr
    for micro_step in range(gradient_accumulation_steps):
        if batches:
            X, Y = batches[micro_step]
        with ctx:
            logits, loss = model(X, Y)
            loss = loss / gradient_accumulation_steps
        if not batches:
            X, Y = get_batch('train')
        scaler.scale(loss).backward()
    if grad_clip != 0.0:
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    t1 = time.time()
    dt = t1 - t0
    t0 = t1
    if iter_num % log_interval == 0:
        lossf = loss.item() * gradient_accumulation_steps
        if local_iter_num >= 5:
            mfu = model.estimate_mfu(batch_size * gradient_accumulation_steps, dt)
            running_mfu = mfu if running_mfu == -1.0 else 0.9*running_mfu + 0.1*mfu
        print(f"iter {iter_num}: loss {lossf:.4f}, time {dt*1000:.2f}ms, "
              f"mfu {running_mfu*100:.2f}%")
    iter_num += 1
    local_iter_num += 1
"""


def script(data_dir: str) -> dict:
    """The script run as ``python train.py`` would (from a file: errors quote its lines)."""
    path = os.path.join(data_dir, "train.py")
    with open(path, "w") as f:
        f.write(SCRIPT)
    namespace = {"__name__": "nanogpt_train", "data_dir": data_dir}
    exec(compile(SCRIPT, path, "exec"), namespace)
    return namespace


@pytest.fixture
def data_dir(tmp_path) -> str:
    torch.manual_seed(0)
    torch.randint(0, 65, (3000,)).numpy().astype("uint16").tofile(tmp_path / "train.bin")
    return str(tmp_path)


def printed(text: str) -> list[str]:
    """The loop's lines without their times (the clock differs between two runs)."""
    return [re.sub(r", time .*ms", "", line) for line in text.splitlines()]


def test_nanogpt_batches_drawn_in_the_step_get_advice_that_gives_eagers_training(
    data_dir: str, capsys, caplog
) -> None:
    ns = script(data_dir)
    state = {k: v.clone() for k, v in ns["model"].state_dict().items()}
    prefetched = ns["X"]
    step = functacc.jit(ns["iteration"], modules=[ns["model"]], optimizers=[ns["optimizer"]])
    with pytest.raises(functacc.TraceError) as info:
        step()
    message = str(info.value)
    assert "indexes NumPy array 'data' with a tensor's value" in message
    line = next(i for i, t in enumerate(SCRIPT.splitlines(), 1) if "data[i:i+block" in t)
    assert f"train.py:{line} in get_batch\n" in message
    assert "run `X, Y = get_batch('train')` before the call" in message
    # nothing was written: weights, optimizer state, the script's counter and batch
    assert all(torch.equal(v, state[k]) for k, v in ns["model"].state_dict().items())
    assert ns["optimizer"].state == {} and ns["iter_num"] == 0 and ns["X"] is prefetched

    eager = script(data_dir)
    capsys.readouterr()
    for _ in range(8):
        eager["iteration"]()
    eager_lines = printed(capsys.readouterr().out)

    ns = script(data_dir)
    step = functacc.jit(
        ns["iteration"], modules=[ns["model"]], optimizers=[ns["optimizer"]], backend="eager"
    )
    caplog.set_level(logging.WARNING, logger="functacc")
    for _ in range(8):
        # the advice: the step's two batches drawn before the call, in eager's order (the
        # first one prefetched by the previous iteration, as train.py does)
        batches = [(ns["X"], ns["Y"]), ns["get_batch"]("train")]
        prefetch = ns["get_batch"]("train")
        step(*batches)
        ns["X"], ns["Y"] = prefetch
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("iter")]
    assert printed("\n".join(lines)) == eager_lines and len(lines) == 8
    assert (ns["iter_num"], ns["local_iter_num"]) == (eager["iter_num"], eager["local_iter_num"])
    assert ns["running_mfu"] > 0  # the estimate from each call's own time, from iteration 5
    assert ns["optimizer"].param_groups[1]["lr"] == eager["optimizer"].param_groups[1]["lr"]
    expected = eager["model"].state_dict()
    assert all(torch.equal(v, expected[k]) for k, v in ns["model"].state_dict().items())
    # a trace per outcome of the loop's branches: get_lr's warm-up, cosine and floor, and the
    # MFU estimate's none (first five iterations), first, and later ones
    assert step.num_traces == 5
    # get_lr's result sets the learning rate: the retrace warnings do not advise running it
    # on the host with functacc.host (before 2026-11-29 they did)
    warned = [r.getMessage() for r in caplog.records if "branch on fed" in r.getMessage()]
    assert len(warned) == 3 and all("functacc.host" not in w for w in warned)
    assert all("in get_lr (result used by the step)" in w for w in warned)


def test_a_host_function_whose_result_sets_the_learning_rate_is_a_clear_error(
    data_dir: str,
) -> None:
    # Had the advice been followed: torch's C++ got the stand-in for get_lr's result, and
    # the error was "full(): argument 'fill_value' must be Number, not _Unknown".
    ns = script(data_dir)
    ns["get_lr"] = functacc.host(ns["get_lr"])
    state = {k: v.clone() for k, v in ns["model"].state_dict().items()}
    step = functacc.jit(
        ns["iteration"], modules=[ns["model"]], optimizers=[ns["optimizer"]], backend="eager"
    )
    with pytest.raises(functacc.TraceError, match=r"uses the result of get_lr\(\), a functacc.h"):
        step((ns["X"], ns["Y"]), ns["get_batch"]("train"))
    assert all(torch.equal(v, state[k]) for k, v in ns["model"].state_dict().items())
    assert ns["optimizer"].state == {} and ns["iter_num"] == 0
