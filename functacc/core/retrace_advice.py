"""What to advise a user whose step was traced again, by the reason of the trace.

The cache tells why a call did not match a graph it has (a dimension, a module attribute,
a branch on a number that changed, a NumPy array's contents); :func:`retrace_fix` turns that
reason into the fix that works in that situation, for the warning a third trace logs and
for :class:`~functacc.RetraceError`.

Example:
    >>> retrace_fix("module attributes: dropout.p 0.1 -> 0.2").startswith("A traced forward")
    True
"""

from __future__ import annotations

import re

__all__ = ["branch_fix", "retrace_fix"]


def retrace_fix(reason: str, static: bool = False) -> str:
    """The advice for a step traced again for ``reason`` (a trace's reason, as the cache
    tells it); ``static``: the step traces static sizes only (recurrent layers)."""
    if "<NumPy array" in reason:
        return (
            "The step converts a NumPy array (an argument, a variable or an attribute it reads) "
            "into the graph, where its values are constants: each new content costs a trace. "
            "Fix: pass the data to the call as a tensor, step(torch.from_numpy(obs)), and use "
            "it as the tensor in the step."
        )
    if reason.startswith("module attributes"):
        return (
            "A traced forward bakes in the Python values it reads from the model's modules, "
            "so a changed attribute costs a trace and a compile, as it would make "
            "torch.compile recompile. If forward does not read it, keep it elsewhere or give "
            "it a name starting with '_' (not part of the signature); if it does and changes "
            "often, make it a tensor buffer (register_buffer, updated in place), which the "
            "graph reads afresh on every call."
        )
    if "values, read at" in reason:
        return (
            "The step reads the values of a tensor of the batch as Python numbers (its "
            "lengths for pack_padded_sequence, .tolist(), int(), a branch on them) at the "
            "line named, so each new value costs a trace and a compile, as eager takes "
            "another path. Fix: keep the values few (bucket and sort batches by length), "
            "or compute with the tensor (a mask, torch.where) instead of Python numbers."
        )
    if re.search(r"\.__len__\(\): \d+ -> \d+", reason):
        return (
            "The step reads the length of a list, deque or dict in its Python state (a "
            "replay memory's len(memory) < BATCH_SIZE), so each new length costs a trace "
            "while it grows. Fix: check the length before the call (if len(memory) >= "
            "BATCH_SIZE: step(...)), or give the step a counter that changes less often."
        )
    if "a tensor in one call, None in another" in reason:
        return (
            "An argument, or an item in one, is None in some calls and a tensor in others, "
            "and each pattern of them is a trace and a compile (DQN's replay batch, a "
            "transition's next_state None at an episode's end: a pattern per batch). Fix: "
            "pass a tensor in every call (zeros where there is none) and a mask of which are "
            "real (done = torch.tensor([s is None for s in batch.next_state])), and compute "
            "with the mask: torch.where(done, 0.0, target_net(next_states).max(1).values)."
        )
    if "a tensor in one call" in reason:
        return (
            "An argument, or an item in one, is a tensor in some calls and a Python value in "
            "others, and each pattern is a trace and a compile. Fix: pass the same kind in "
            "every call (a tensor, with a mask for the calls where it has no value)."
        )
    if "branch on fed numbers" in reason:
        return branch_fix(reason)
    if re.match(r"python .*\[\d+\]: ", reason):
        return (
            "The step reads an item of a list in its Python state that is not a number it "
            "can feed to the graph (a flag per transition: if is_terminal), so each new "
            "value costs a trace and a compile. Fix: give the step those values as a tensor "
            "(step(torch.tensor(flags))) and compute with it (torch.where), or branch "
            "outside the step."
        )
    if (" dim " in reason or "guard" in reason) and static:
        return (
            "Each new input size costs a trace and a compile, and this step traces static "
            "sizes only (its recurrent layers run eager's kernels, which take no symbolic "
            "size). Fix: pad batches to a few sizes with functacc.DeviceLoader(loader, "
            "buckets=[...]), or pad sequences to a fixed length."
        )
    if "guard" in reason:  # a symbolic graph was there: dynamic=True would not help
        return (
            "Each new input size costs a trace and a compile: the step fixed these sizes "
            "(it branched in Python on them, or on values made from them, as torch's "
            "transformer layers do on an attention mask; or a size was 0 or 1, which torch "
            "traces apart). Fix: pad batches to a few sizes "
            "with functacc.DeviceLoader(loader, buckets=[...])."
        )
    if " dim " in reason and "draws with one of them" in reason:
        return (
            "Each new input size costs a trace and a compile: a draw from NumPy or random "
            "sized by the batch fixes the sizes (it is drawn again before each call, at its "
            "size). Fix: draw with torch (torch.randn(x.shape[0], d): symbolic sizes), or "
            "pad batches to a few sizes with functacc.DeviceLoader(loader, buckets=[...])."
        )
    if " dim " in reason:
        return (
            "Each new input size costs a trace and a compile. Fix: dynamic=True (of jit or "
            "compile_step) traces sizes symbolically from the first call, or pad batches to "
            "a few sizes with functacc.DeviceLoader(loader, buckets=[...])."
        )
    return (
        "The step is traced once per distinct signature (input dtypes and layouts, train/eval "
        "mode, trainable parameters, the modules' plain attributes such as a dropout's p, "
        "optimizer structure, ambient autocast). Keep what changed constant between steps, "
        "or expect one trace per variant."
    )


def branch_fix(reason: str) -> str:
    """The advice for a step traced again because it branched in Python on a number that
    changed (a counter, the clock, a number it computed), naming the function it was in."""
    sites = re.finditer(r":\d+ in ([A-Za-z_]\w*)( \(the step\)| \(via (\w+)\)| \(result)?", reason)
    called = [m[3] or m[1] for m in sites if m[2] not in (" (the step)", " (result")]
    host = (
        f"If that code only shows or logs what the step computed (a progress bar, a time "
        f"formatted), wrap the function the step calls with functacc.host ({called[0]} = "
        f"functacc.host({called[0]})): it then runs after each call with the call's values, "
        "not traced. "
        if called
        else ""
    )
    return (
        "The step branches in Python on numbers that change between calls: each new outcome "
        "costs a trace (a branch with few outcomes, it % k == 0, a few traces in all). "
        f"{host}{'Else' if host else 'Fix:'} branch with tensors (torch.where), or keep the "
        "number constant."
    )
