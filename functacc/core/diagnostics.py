"""How failures of tracing and of a compiled run read.

An exception raised while tracing becomes a :class:`~functacc.TraceError` that names the
module and the source line it came from and the step's inputs, and says what to do: a
branch on a tensor's value (data-dependent control flow), inputs the model rejects, a
generator torch cannot trace. A compiled run that fails (a collective, a dtype rule fake
tensors do not check) says that nothing was written.
"""

from __future__ import annotations

import re

import torch
from torch import Tensor, nn

from .. import _compat
from ..errors import TraceError
from .failure_sites import (
    anomaly_checks,
    formats_with_percent,
    in_function,
    in_package,
    is_data_dependent,
    library_call,
    library_code,
    numpy_index,
    optim_utility,
    optimizer_step,
    random_transform,
    user_frame,
    user_module,
)
from .host_calls import host_result_used

__all__ = ["describe_leaves", "describe_tensor", "message_root", "run_error", "translate"]


def describe_tensor(t: Tensor) -> str:
    dtype = str(t.dtype).removeprefix("torch.")
    return f"{tuple(t.shape)} {dtype} on {t.device}"


def describe_leaves(leaves: list) -> str:
    """A call's leaves for messages: each tensor's shape, dtype and device, other values
    as they print."""
    parts = [describe_tensor(x) if isinstance(x, Tensor) else repr(x) for x in leaves]
    return "; ".join(parts) or "no inputs"


def message_root(modules: list[nn.Module], labels: list[str]) -> nn.Module:
    """The modules under one root, for messages that name a module by its label (a single
    module is its own root: its submodules are named as in ``named_modules()``)."""
    if len(modules) == 1:
        return modules[0]
    root = nn.Module()
    for label, module in zip(labels, modules, strict=True):
        root.add_module(label, module)
    return root


def _where(exc: BaseException, model: nn.Module) -> str:
    tb = exc.__traceback__
    frame = user_frame(tb)
    module = user_module(tb, model)
    parts = []
    if module:
        parts.append(f"in module {module}")
    if frame is not None:
        parts.append(f"at {frame.filename}:{frame.lineno}")
        if frame.line:
            parts.append(f"\n    {frame.line.strip()}")
    return " ".join(parts) if parts else "(location unknown)"


def translate(
    exc: BaseException,
    model: nn.Module,
    signature: str,
    eager_call: str | None = None,
) -> TraceError:
    """The error for a trace that failed with ``exc``; ``eager_call`` is the eager code the
    same inputs must run with (by default compile_step's ``loss_fn(model(inputs),
    targets)``; a jitted body called eagerly)."""
    eager_call = eager_call or "loss_fn(model(inputs), targets)"
    where = _where(exc, model)
    if is_data_dependent(exc) and anomaly_checks(exc):
        return TraceError(
            "autograd's anomaly detection checks every gradient for NaN on the host "
            f"(torch.autograd.detect_anomaly / set_detect_anomaly(True)) {where}\nfunctacc "
            "traces the whole step once into a graph, which cannot stop on a value. Fix: to "
            "find a NaN, call the function you gave to jit directly (eager, with anomaly "
            "detection); in the jitted step, leave it out or pass check_nan=False (a "
            "non-finite loss: `if not math.isfinite(loss.item()): sys.exit(1)` is asserted "
            f"in the graph). Inputs were: {signature}."
        )
    if is_data_dependent(exc) and in_function(exc, "_detect_is_causal_mask"):
        return TraceError(
            "torch's transformer layers check whether the attention mask is causal by "
            f"comparing its values, which a traced step cannot do for a mask it computes "
            f"{where}\nFix: pass is_causal=True with a causal mask (mask=..., "
            "is_causal=True: torch then skips the check), or pass the mask as an argument "
            "of the step (functacc then reads its values at the trace and retraces for a "
            f"mask with other values). Inputs were: {signature}."
        )
    if is_data_dependent(exc) and in_function(exc, "_maybe_opt_step"):
        return TraceError(
            "torch.amp.GradScaler.step() decides on the host whether to skip the optimizer "
            f"step {where}\nfunctacc.jit moves that decision into the graph for a "
            "GradScaler the body holds (in its closure or globals, or as an attribute of an "
            "object it reaches, like self.scaler) and whose optimizer is one of the step's; "
            "this one it reached otherwise (an argument of the step?) or its optimizer is not "
            "in optimizers=. Fix: create the scaler outside the step and refer to it by name "
            f"there, and pass its optimizer in optimizers=. Inputs were: {signature}."
        )
    metric = in_package(exc, "torchmetrics") if is_data_dependent(exc) else None
    if metric is not None:
        return TraceError(
            f"torchmetrics reads a tensor's value on the host in {metric} {where}\n"
            "A graph traced once cannot (its argument checks under validate_args=True, a "
            "MetricCollection's compute groups on its first update, a check in compute()). "
            "Fix: build the metric with validate_args=False (a MetricCollection with "
            "compute_groups=False); call metric.update(...) in the step and compute() after "
            "it; or update it outside the jitted step with tensors the step returns "
            f"(metric.update(logits, y) after the call). Inputs were: {signature}."
        )
    pyg = in_package(exc, "torch_geometric", True) if is_data_dependent(exc) else None
    if pyg is not None:
        return TraceError(
            f"PyTorch Geometric's {pyg}() reads a tensor's value {where}\nIt does so to find "
            "a size it was not given (the number of graphs in a batch: int(batch.max()) + 1), "
            "which a graph traced once cannot. Fix: give the size: global_mean_pool(x, batch, "
            "size=data.num_graphs) (and the other global_*_pool), to_dense_batch(x, batch, "
            "batch_size=data.num_graphs), scatter(..., dim_size=...); a Batch passed to the "
            f"step is read afresh every call. Inputs were: {signature}."
        )
    transform = random_transform(exc) if is_data_dependent(exc) else None
    if transform is not None:
        return TraceError(
            f"torchvision's {transform} decides on the host what it does to the batch, from "
            f"a number torch drew {where}\nA graph traced once cannot: the decision (flip or "
            "not, the crop's corner) would be taken once, at the trace, where eager takes it "
            "at every call. Fix: transform the batch before the call (step(aug(x), y)), or "
            "each sample in the dataset's transform, the usual place (the numbers are eager's "
            "where the step draws nothing before the transform). Inputs were: "
            f"{signature}."
        )
    indexed = numpy_index(exc) if is_data_dependent(exc) else None
    if indexed is not None:
        array, at, call = indexed
        return TraceError(
            f"the step indexes NumPy array '{array}' with a tensor's value {at}\nThe array "
            "is host data and the position exists only when the graph runs (a batch drawn "
            "in the step: positions from torch.randint into data on the host), so a graph "
            f"traced once cannot. Fix: run `{call}` before the call and pass what it makes "
            "to the step as arguments (one per batch the step drew), or keep the data a "
            f"tensor and gather from it with tensor indices. Inputs were: {signature}."
        )
    utility = optim_utility(exc) or library_call(exc) if is_data_dependent(exc) else None
    if utility is not None:
        owner = "torch's own code" if utility[1] == "torch" else f"code of {utility[1]}"
        return TraceError(
            f"{utility[0]} reads a tensor's value as a Python number {where}\n"
            f"That is {owner} for between steps, which a graph traced once cannot "
            "run (the value decides what it does). Fix: call it outside the jitted step, "
            "right after each call (return what it needs, e.g. the loss, from the step): "
            "between calls the modules and optimizers hold the step's results, as in eager. "
            f"Inputs were: {signature}."
        )
    frame = user_frame(exc.__traceback__) if is_data_dependent(exc) else None
    if frame is not None and formats_with_percent(exc.__traceback__):
        return TraceError(
            f"the step formats a tensor with '%' {where}\nstr.__mod__ asks the tensor for a "
            "Python number, which exists only after the call. Fix: format its .item() "
            "('loss %.4f' % loss.item()) or use an f-string (f'loss {loss:.4f}'): functacc "
            f"fills either in after each call. Inputs were: {signature}."
        )
    if frame is not None and any(f"{c}(" in (frame.line or "") for c in _VALUE_CHECKS):
        return TraceError(
            f"the step checks a value on the host {where}\nfunctacc traces the whole step "
            "once into a graph, so the check would be decided once, at the trace, where "
            "eager decides it on every call (`if not torch.isfinite(loss): sys.exit(1)`). "
            "Fix: check loss.item() with math.isfinite (functacc asserts it in the graph: a "
            "call with a non-finite value fails, changing nothing), or return loss.item() "
            "from the step and check it after the call; to skip the update "
            "of a step whose gradients are not finite, use a torch.amp.GradScaler in the "
            f"step, whose skip functacc runs inside the graph. Inputs were: {signature}."
        )
    line = (frame.line or "") if frame is not None else ""
    if (
        frame is not None
        and frame.name != "forward"
        and re.match(r"\s*(if|elif)\b.*\.item\(\)", line)
    ):
        return TraceError(
            f"the step branches on a tensor's value {where}\nfunctacc traces the whole step "
            "once into a graph, so the branch would be decided once, at the trace, where "
            "eager decides it on every call. Fix: return the value from the step (return "
            "loss.item()) and branch after the call, where eager's numbers are (a best-loss "
            "check, saving a checkpoint: the update of that call is done by then); inside the "
            f"step, select with torch.where. Inputs were: {signature}."
        )
    package = library_code(exc) if is_data_dependent(exc) else None
    if package is not None:
        return TraceError(
            f"{package[0]}'s code reads a tensor's value as a Python number in {package[1]} "
            f"({package[2]}), called {where}\nIt decides a size or a branch from the data (a "
            "detection model's resizing, proposals and NMS do), which a graph traced once "
            "cannot: functacc compiles the whole step into one graph, without breaks. Fix: "
            f"look for an option of {package[0]} that avoids the read; otherwise keep this "
            "model out of the jitted step (train it eagerly, or with torch.compile, which "
            f"splits its graph where the data decides). Inputs were: {signature}."
        )
    stepping = optimizer_step(exc) if is_data_dependent(exc) else None
    if stepping is not None:
        return TraceError(
            f"{stepping}.step() reads a tensor's value as a Python number (to branch on it "
            f"or to pick one with max/min) {where}\nfunctacc traces the whole training step "
            "once into a graph, which cannot branch on tensor values: the choice would be "
            "made once, at the trace, where eager makes it at every step. Fix: call the "
            "optimizer's step() after the jitted function (opt.step() after each call, the "
            "optimizer still given in optimizers=: the call leaves .grad as eager does), or "
            "choose an option of the optimizer that avoids the read (for Hugging Face's "
            f"Adafactor: scale_parameter=False). Inputs were: {signature}."
        )
    if is_data_dependent(exc):
        return TraceError(
            "functacc traces the whole training step once into a graph, so Python code "
            "cannot branch on tensor values or use them as Python numbers (if/while on a "
            "tensor; its .item(), int() or .tolist() as a condition, an index, a slice or a "
            "size; data-dependent shapes such as nonzero(); returning or storing loss.item() "
            f"is fine), but the step does so {where}\n"
            "Expected: control flow, indices and sizes that depend only on shapes, dtypes "
            "and Python values. Fix: keep the value a tensor: torch.where(cond, a, b) or "
            "torch.cond(pred, true_fn, false_fn, operands) for a branch; a tensor index for "
            "a position kept in a tensor (x[:, (ptr + torch.arange(n)) % size] = y, then "
            "ptr.add_(n).remainder_(size)); or move the check out of forward(). Inputs "
            f"were: {signature}."
        )
    message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if (
        isinstance(exc, NotImplementedError)
        and "Generator" in message
        and not _compat.make_fx_traces_generators()
    ):
        return TraceError(
            f"the training step draws from a torch.Generator passed to an op {where}\n"
            f"torch {torch.__version__} cannot trace that ({type(exc).__name__}: {message}); "
            "torch 2.14 and later can. Fix: draw from torch's default generator (leave out "
            "generator=, seed with torch.manual_seed) or install a newer torch (pip install "
            "'torch>=2.14,<2.16')."
        )
    host_result = host_result_used(exc)
    if host_result is not None:
        return host_result
    notes = "".join(f"{note}\n" for note in getattr(exc, "__notes__", ()))  # e.g. a split's
    return TraceError(
        f"tracing the training step failed {where}\n"
        f"{type(exc).__name__}: {message}\n{notes}"
        f"Inputs were: {signature}. Check that the inputs have the shapes, dtypes and "
        f"devices the model expects (the same call must work in eager PyTorch: {eager_call})."
    )


_VALUE_CHECKS = ("isfinite", "isnan", "isinf")  # math's or torch's, on a loss


def _is_collective_failure(exc: BaseException) -> bool:
    import torch.distributed as dist

    text = f"{type(exc).__name__} {exc}".lower()
    markers = ("gloo", "nccl", "connection", "timed out", "timeout", "peer", "c10d")
    return isinstance(exc, getattr(dist, "DistError", ())) or any(m in text for m in markers)


def run_error(exc: BaseException, signature: str) -> TraceError:
    """A compiled step that traced fine but failed while running (fake tensors do not check
    every rule, e.g. some dtype mismatches; or a collective failed). The step writes its
    state only after all computation, so nothing was updated."""
    message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if _is_collective_failure(exc):
        return TraceError(
            "a collective of the training step failed: another rank has probably exited or "
            "crashed, or the network between ranks failed. This rank's model and optimizer "
            f"are unchanged by the failed step.\n{type(exc).__name__}: {message}\nEvery rank "
            "waits for the others at most the process group's timeout "
            "(functacc.init_distributed(timeout=...) or FUNCTACC_TIMEOUT seconds); restart "
            "the job from the last checkpoint (torchrun --max-restarts does it automatically)."
        )
    check = (
        ""
        if message.startswith("functacc:")
        # a check of functacc's, in words
        else (
            " Check that the inputs have the dtypes and devices the model expects (the same call "
            "fails in eager PyTorch too)."
        )
    )
    return TraceError(
        f"the compiled training step failed while running, before it wrote any state (model, "
        f"optimizer and step count are unchanged)\n{type(exc).__name__}: {message}\n"
        f"Inputs were: {signature}.{check}"
    )
