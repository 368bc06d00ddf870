"""The engine that every front door shares: capture -> trace -> transform -> compile -> run.

- :mod:`.capture`: the state a step touches (its modules' parameters, buffers, tensor
  attributes and ``.grad``; its optimizers' state) lifted into one flat, named list of
  tensors, swapped into the modules while tracing and written back after each call;
- :mod:`.optimizers`: ``opt.step()`` of a ``torch.optim`` optimizer, traced as functacc's
  pure twin of it (bit for bit with ``torch.optim``) over the captured state;
- :mod:`.engine`: traces a step body once per signature with ``make_fx`` (autograd and
  in-place updates included), functionalizes it (every write lands at the end of the
  graph), compiles it, and runs it.
"""
