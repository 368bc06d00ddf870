"""Inductor-only code: how functacc compiles a graph with Inductor and what it changes there.

``compile.py`` compiles one graph with functacc's settings; on CPU it adds a post-grad pass
(``bias_add.py``: a linear layer's bias added in a generated kernel, not by ``addmm``) and
two changes to the generated code (``input_checks.py``: the input checks in one call;
``independent_loops.py``: no barriers between independent loop nests), and ``call.py``
calls the result without the runtime wrappers around it. ``masks.py`` draws dropout's masks
into bytes before Inductor compiles the graph, with ``bernoulli.py``'s kernel where it
can be built.
"""

from .compile import compile_inductor

__all__ = ["compile_inductor"]
