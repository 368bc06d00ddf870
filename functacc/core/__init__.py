"""The engine that every front door shares: trace -> transform -> compile -> run.

- :mod:`.engine`: one program per signature, traced by :mod:`.tracer`, compiled by
  :mod:`functacc.backends`, kept in :mod:`.cache`, run;
- :mod:`.signature`, :mod:`.model_watch`, :mod:`.guards`: what a graph depends on besides
  its inputs' shapes, checked per call; :mod:`.differences` says why a step retraces;
- :mod:`.watches`, :mod:`.diagnostics`: what a trace refuses, and errors that name the
  module and the source line;
- :mod:`.functional`: a module as a pure function of its parameters and buffers;
- for ``jit``'s eager step bodies: :mod:`.body` runs a body on the engine (one trace:
  :mod:`.body_trace`) over the state :mod:`.capture` lifts (with :mod:`.optimizers`
  tracing ``opt.step()``), with donated inputs (:mod:`.donation`) and graph passes
  (:mod:`.graph_passes`);
- the body's Python state (:mod:`.python_state`): where it lives (:mod:`.python_reach`),
  what one trace reads and writes (:mod:`.python_trace`, :mod:`.python_recording`), what
  is replayed around each call (:mod:`.python_effects`).
"""
