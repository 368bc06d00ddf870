"""Tensor parallelism under torchrun, for tests/test_tensor_parallel.py:
``tp_worker.py OUT TP [CHECKPOINT_IN]``.

Every rank trains each model of ``MODELS`` (an MLP, a GPT-style stack with a tied embedding and
a vocabulary-parallel loss, a tiny Hugging Face Llama) through both front doors with
``parallel=[TensorParallel(plan, size=TP), DataParallel()]``: the ranks of one tensor-parallel
group take the same batch, each replica its share of the global batch. Rank 0 saves the losses,
the gathered parameters and what each rank held; the test trains the same models in one
process on the whole batches and compares. With CHECKPOINT_IN, the MLP's compile_step first
loads that checkpoint (written by one process); the worker also writes one after its steps.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import functacc
from functacc.bench.distributed import TP_PLANS
from functacc.parallel import DataParallel, TensorParallel, vocab_parallel_cross_entropy

STEPS = 4
BATCH = 8  # the global batch
V, D, T = 32, 16, 8


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 8), nn.LayerNorm(8),
        nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4),
    )  # fmt: skip


MLP_PLAN = {"0": "colwise", "2": "rowwise", "4": "colwise", "6": "rowwise"}


class Block(nn.Module):
    def __init__(self, dropout: float) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.q, self.k, self.v, self.o = (nn.Linear(D, D) for _ in range(4))
        self.up, self.down = nn.Linear(D, 4 * D), nn.Linear(4 * D, D)
        self.head_dim = D // 4  # 4 heads; the reshapes use -1 for the count
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        h = self.ln1(x)
        q, k, v = (
            f(h).view(b, t, -1, self.head_dim).transpose(1, 2) for f in (self.q, self.k, self.v)
        )
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.drop(self.o(a.transpose(1, 2).reshape(b, t, -1)))
        return x + self.drop(self.down(F.gelu(self.up(self.ln2(x)))))


class GPT(nn.Module):
    def __init__(self, dropout: float = 0.0) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(V, D), nn.Embedding(T, D)
        self.blocks = nn.ModuleList(Block(dropout) for _ in range(2))
        self.ln_f = nn.LayerNorm(D)
        self.lm_head = nn.Linear(D, V, bias=False)
        self.lm_head.weight = self.wte.weight  # tied

    def forward(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.wte(ids) + self.wpe(torch.arange(ids.shape[1]))
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))  # this rank's share of the vocabulary
        return vocab_parallel_cross_entropy(logits.flatten(0, 1), targets.flatten(), self)


class FullHeads(nn.Module):
    """Attention-like code that bakes the full head count into a reshape."""

    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.Module()
        self.attn.q, self.attn.o = nn.Linear(D, D), nn.Linear(D, D)
        self.attn.forward = self.heads

    def heads(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        return self.attn.o(self.attn.q(x).view(b, t, 4, D // 4).flatten(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.attn(x).square().mean()


def gpt(dropout: float = 0.0) -> nn.Module:
    torch.manual_seed(0)
    return GPT(dropout)


GPT_PLAN = {
    "wte": "vocab", "blocks.*.q": "colwise", "blocks.*.k": "colwise", "blocks.*.v": "colwise",
    "blocks.*.o": "rowwise", "blocks.*.up": "colwise", "blocks.*.down": "rowwise",
    "lm_head": "colwise",
}  # fmt: skip


def llama() -> nn.Module:
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=V, hidden_size=D, intermediate_size=2 * D, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=T,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


def llama_plan(model: nn.Module) -> dict[str, str]:
    # The model's own plan as is, plus its embedding and output layer (Hugging Face's
    # lm_head style gathers the logits for its loss).
    return {**model.config.base_model_tp_plan, "embed_tokens": "rowwise", "lm_head": "colwise_rep"}


def hf_gpt2() -> nn.Module:
    import transformers

    config = transformers.GPT2Config(
        vocab_size=V, n_positions=T, n_embd=D, n_layer=2, n_head=4, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config)


def batches() -> list[tuple[torch.Tensor, ...]]:
    torch.manual_seed(1)
    return [
        (torch.randn(BATCH, 8), torch.randint(0, 4, (BATCH,)), torch.randint(0, V, (BATCH, T)))
        for _ in range(STEPS)
    ]


def optimizer(name: str, model: nn.Module) -> torch.optim.Optimizer:
    # AdamW for the MLP; SGD with momentum for the others, whose near-zero gradients Adam
    # would turn into lr-sized steps of rounding noise.
    if name == "mlp":
        return torch.optim.AdamW(model.parameters(), lr=1e-2)
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


MODELS = {
    "mlp": (mlp, lambda m: MLP_PLAN),
    "gpt": (gpt, lambda m: GPT_PLAN),
    "llama": (llama, llama_plan),
    # Hugging Face's Conv1D layers: the bench's plan (its fused attention stays whole).
    "hf_gpt2": (hf_gpt2, lambda m: TP_PLANS["gpt2"]),
}


def loss_of(name: str, model: nn.Module, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
    x, y, ids = batch
    if name == "mlp":
        return F.cross_entropy(model(x), y)
    if name == "gpt":
        return model(ids, ids.roll(-1, 1))
    return model(input_ids=ids, labels=ids).loss  # the Hugging Face models


def build(
    name: str,
    front: str,
    parallel: object,
    backend: str = "eager",
    dropout: float = 0.0,
    across: object = None,
) -> tuple:
    """(step, model, optimizer[, compile_step's step]): ``step(*batch)`` trains one step
    and returns the loss; ``across`` is the strategy across the tensor-parallel groups."""
    make, plan = MODELS[name]
    model = make(dropout) if dropout else make()
    opt = optimizer(name, model)
    if front == "body":  # compile_step with an optimizer traced whole: jit's pipeline
        opt = torch.optim.RMSprop(model.parameters(), lr=1e-3)
    if front == "transform":  # a functacc.optim transformation: torch's AdamW, purely
        opt = functacc.optim.adamw(1e-2)
    # The clipping in the transformation (clip_by_global_norm, then AdamW): compile_step
    # and a jitted body with as_optimizer.
    clip = functacc.optim.clip_by_global_norm(0.5)
    if front in ("transform_clip", "transform_clip_jit"):
        opt = functacc.optim.chain(clip, functacc.optim.adamw(1e-2))
    if front == "transform_clip_jit":
        opt = functacc.optim.as_optimizer(model.named_parameters(), opt)
    parallel = [TensorParallel(plan(model), size=parallel), across or DataParallel()]
    if front in ("jit", "transform_clip_jit"):

        def body(*batch: torch.Tensor) -> torch.Tensor:
            opt.zero_grad()
            loss = loss_of(name, model, batch)
            loss.backward()
            if front == "jit":
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            opt.step()
            return loss.detach()

        jitted = functacc.jit(
            body, modules=[model], optimizers=[opt], backend=backend, parallel=parallel
        )
        return jitted, model, opt
    kwargs = dict(backend=backend, parallel=parallel, max_grad_norm=0.5)
    if front == "transform_clip":
        kwargs["max_grad_norm"] = None
    if name == "mlp":
        step = functacc.compile_step(model, nn.CrossEntropyLoss(), opt, **kwargs)
        return (lambda x, y, ids: step(x, y)), model, step.optimizer, step
    if name == "gpt":
        step = functacc.compile_step(model, None, opt, **kwargs)
        return (lambda x, y, ids: step(ids, ids.roll(-1, 1))), model, opt, step
    step = functacc.compile_step(model, None, opt, **kwargs)
    return (lambda x, y, ids: step(input_ids=ids, labels=ids)), model, opt, step


def main() -> None:
    out, tp = sys.argv[1], int(sys.argv[2])
    functacc.init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    replicas, replica = world // tp, rank // tp
    results: dict = {}
    # Across groups (4 ranks on a 2-core machine, slow): the MLP and the GPT-style stack (the
    # Hugging Face models pass too: run with MODELS), and ZeRO: compile_step's stages 1 and 3,
    # jit's 2.
    names = list(MODELS) if replicas == 1 else ["mlp", "gpt"]
    runs = [(name, front, None) for name in names for front in ("compile_step", "jit")]
    runs.append(("mlp", "body", None))  # for stats() only (another optimizer)
    if replicas == 1:
        runs += [("mlp", front, None) for front in ("transform", "transform_clip")]
        runs.append(("mlp", "transform_clip_jit", None))
    if replicas > 1:
        runs += [("mlp", "compile_step", 1), ("mlp", "compile_step", 3), ("mlp", "jit", 2)]
        runs += [("mlp", "jit", 3)]
    for name, front, stage in runs:
        across = functacc.parallel.ZeRO(stage) if stage else None
        step, model, opt, *compiled = build(name, front, tp, across=across)
        losses = []
        for x, y, ids in batches():
            mine = [t.chunk(replicas)[replica] for t in (x, y, ids)]
            losses.append(float(step(*mine)))
        mean = torch.tensor(losses)  # the replicas' losses averaged: the whole batch's
        dist.all_reduce(mean)
        losses = (mean / world).tolist()
        layout = model._functacc_tensor_parallel
        split = sum(p.numel() for n, p in model.named_parameters() if n in layout.dims)
        state = [
            t.numel() for p, s in opt.state.items() for t in s.values()
            if torch.is_tensor(t) and t.dim() > 0 and p.dim() > 0
            and any(p is q for n, q in model.named_parameters() if n in layout.dims)
        ]  # fmt: skip
        if stage:
            # Between calls ZeRO-3 leaves the model empty placeholders (its chunks are held).
            held = sum(p.numel() for p in model.parameters())
            if stage == 3:  # the parameters back into the model (a collective call)
                compiled[0].sync_model() if compiled else step.sync_modules()
            results[name, front, stage] = {
                "losses": losses,
                "params": layout.full_state_dict(model),
                "held": held,
                "strategy": compiled[0].stats()["strategy"] if compiled else None,
            }
            continue
        results[name, front] = {
            "losses": losses,
            "params": layout.full_state_dict(model),
            "split_names": sorted(layout.dims),
            "split_numel": split,
            "split_state_numel": sum(state),
            "stats": compiled[0].stats() if compiled else None,
        }
    if len(sys.argv) > 3:
        results.update(extras(sys.argv[3], tp))
    if rank == 0:
        torch.save(results, out)
    dist.barrier()


def extras(folder: str, tp: int) -> dict:
    """The loss over split logits against ``F.cross_entropy``, checkpoints across layouts,
    dropout, and one Inductor run (on one tensor-parallel group)."""
    results: dict = {}
    # Vocabulary-parallel cross-entropy against the whole logits, values and gradients.
    torch.manual_seed(2)
    logits = torch.randn(12, V, requires_grad=True)
    target = torch.randint(0, V, (12,))
    target[3] = -100
    mine = logits.detach().chunk(tp, -1)[dist.get_rank() % tp].requires_grad_(True)
    loss = vocab_parallel_cross_entropy(mine, target, dist.group.WORLD)
    loss.backward()
    F.cross_entropy(logits, target).backward()
    grads = [torch.empty_like(mine.grad) for _ in range(tp)]
    dist.all_gather(grads, mine.grad)
    results["vocab_ce"] = (float(loss), float(F.cross_entropy(logits, target)))
    results["vocab_ce_grads"] = (torch.cat(grads, -1), logits.grad)
    # A checkpoint of one process resumed here, and one of here written for one process.
    batch = batches()
    # "body": compile_step with RMSprop, on jit's pipeline; "transform": functacc.optim.adamw.
    for front in ("compile_step", "body", "transform"):
        for source in ("one", "tp"):
            step, model, opt, compiled = build("mlp", front, tp)
            if source == "one":
                functacc.load(compiled, f"{folder}/{front}/one")
            else:
                for b in batch[:2]:
                    step(*b)
                functacc.save(compiled, f"{folder}/{front}/tp")
            loss = float(step(*batch[2]))
            whole = model._functacc_tensor_parallel.full_state_dict(model)
            results["resumed", source, front] = (loss, whole)
    # Dropout on the replicated activations: the masks of one process with the same seed.
    for front in ("compile_step", "jit"):
        step, model, *_ = build("gpt", front, tp, dropout=0.1)
        torch.manual_seed(3)
        results["dropout", front] = [float(step(*b)) for b in batch]
    # A reshape to the full head count fails with a note naming the module.
    model = FullHeads()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    plan = TensorParallel({"attn.q": "colwise", "attn.o": "rowwise"})
    step = functacc.compile_step(model, None, opt, backend="eager", parallel=plan)
    try:
        step(torch.randn(2, T, D))
    except Exception as e:
        results["full_heads"] = "\n".join([str(e), *getattr(e, "__notes__", [])])
    step, model, *_ = build("mlp", "jit", tp, backend="inductor")
    results["inductor"] = [float(step(*b)) for b in batch]
    results["inductor_params"] = model._functacc_tensor_parallel.full_state_dict(model)
    return results


if __name__ == "__main__":
    main()
