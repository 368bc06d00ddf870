"""Hugging Face's own training loops (transformers' examples, ``*_no_trainer.py``) through
``functacc.jit``, against eager: the batch a ``BatchEncoding`` as the collators give it,
``model(**batch)``, gradient accumulation by the step's index, ``get_scheduler``'s schedule
stepped in the step, weight decay groups, the loss summed with ``.item()``.

Before, a ``BatchEncoding`` argument (a ``UserDict``, which torch's pytree does not open)
was a TraceError naming its ``input_ids`` as a tensor that is none of the step's inputs,
advising to pass it as an argument, which it was. With ``backend="eager"`` losses,
weights and the Python state are compared bit for bit.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from torch import nn

import functacc

N_BATCHES, ACCUMULATE = 6, 2


def batches() -> list[transformers.BatchEncoding]:
    g = torch.Generator().manual_seed(1)
    made = []
    for _ in range(N_BATCHES):
        ids = torch.randint(0, 100, (4, 8), generator=g)
        mask = torch.ones(4, 8, dtype=torch.long)
        mask[:2, 6:] = 0  # padded, as DataCollatorWithPadding pads
        labels = torch.randint(0, 3, (4,), generator=g)
        made.append(
            transformers.BatchEncoding({"input_ids": ids, "attention_mask": mask, "labels": labels})
        )
    return made


def glue_run(jit: bool) -> tuple:
    torch.manual_seed(0)
    config = transformers.BertConfig(
        num_hidden_layers=1,
        hidden_size=32,
        num_attention_heads=4,
        intermediate_size=64,
        vocab_size=100,
        max_position_embeddings=32,
        num_labels=3,
    )
    model = transformers.BertForSequenceClassification(config)
    no_decay = ["bias", "LayerNorm.weight"]
    optimizer_grouped_parameters = [
        {
            "params": [
                p for n, p in model.named_parameters() if not any(nd in n for nd in no_decay)
            ],
            "weight_decay": 0.01,
        },
        {
            "params": [p for n, p in model.named_parameters() if any(nd in n for nd in no_decay)],
            "weight_decay": 0.0,
        },
    ]
    optimizer = torch.optim.AdamW(optimizer_grouped_parameters, lr=5e-4)
    lr_scheduler = transformers.get_scheduler(
        name="linear",
        optimizer=optimizer,
        num_warmup_steps=1,
        num_training_steps=N_BATCHES // ACCUMULATE,
    )
    run = {"completed_steps": 0, "total_loss": 0.0}

    def train_step(step: int, batch: transformers.BatchEncoding) -> torch.Tensor:
        # run_glue_no_trainer.py's loop body (accelerator.backward(loss) is loss.backward()
        # on one process)
        outputs = model(**batch)
        loss = outputs.loss
        run["total_loss"] += loss.detach().float().item()
        loss = loss / ACCUMULATE
        loss.backward()
        if step % ACCUMULATE == 0 or step == N_BATCHES - 1:
            optimizer.step()
            lr_scheduler.step()
            optimizer.zero_grad()
            run["completed_steps"] += 1
        return loss.detach()

    model.train()
    step_fn = functacc.jit(train_step, modules=[model], optimizers=[optimizer], backend="eager")
    losses = [(step_fn if jit else train_step)(i, b) for i, b in enumerate(batches())]
    weights = [p.detach().clone() for p in model.parameters()]
    return losses, weights, run, optimizer.param_groups[0]["lr"], step_fn


def test_run_glue_no_trainer_with_batch_encodings_trains_as_in_eager() -> None:
    losses, weights, run, lr, step = glue_run(jit=True)
    ref_losses, ref_weights, ref_run, ref_lr, _ = glue_run(jit=False)
    assert all(torch.equal(a, b) for a, b in zip(losses, ref_losses, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(weights, ref_weights, strict=True))
    assert run == ref_run and run["completed_steps"] == 4 and lr == ref_lr
    # the step's index branches (accumulate or step): one trace per branch taken, not per batch
    assert step.num_traces <= 4, [t.reason for t in step.traces]


def test_a_batch_encoding_with_state_the_signature_cannot_hold_gets_advice_that_works() -> None:
    torch.manual_seed(0)
    model = nn.Linear(8, 1)

    def body(batch: transformers.BatchEncoding) -> torch.Tensor:
        return model(batch["x"].float()).sum()

    step = functacc.jit(body, modules=[model], backend="eager")
    batch = transformers.BatchEncoding({"x": torch.ones(2, 8)})
    batch._encodings = ["an Encoding"]  # a fast tokenizer's: a list, not hashable
    with pytest.raises(
        TypeError, match=r"BatchEncoding whose attributes \['_encodings'\].*dict\(batch\)"
    ):
        step(batch)
    assert torch.equal(step(dict(batch)), body(dict(batch)))  # the advice, done
