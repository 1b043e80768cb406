"""Rank program: ``run_examples.py NAME[=ARG]...`` runs examples/NAME.py one after another in this rank.

Each runs as ``python examples/NAME.py [ARG]`` runs it (as ``__main__``, with that ``sys.argv``,
its own ``ts.init()`` to ``ts.finalize()``, torch's default generator as a fresh process has it),
between the lines ``EXAMPLE-BEGIN NAME[=ARG]`` and ``EXAMPLE-END NAME[=ARG]``. One job checks them
all, so every rank imports torch and TileLang (and transformers) once rather than once per
example. An example that raises ends this rank and the launcher stops the others: the examples
after it have no markers.
"""

import runpy
import sys
from pathlib import Path

import torch

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
SEED = torch.initial_seed()  # a fresh process's: unseeded examples draw the same data on every rank

for spec in sys.argv[1:]:
    name, *arg = spec.split("=", 1)
    path = str(EXAMPLES / f"{name}.py")
    torch.manual_seed(SEED)
    sys.argv = [path, *arg]
    print(f"EXAMPLE-BEGIN {spec}", flush=True)
    runpy.run_path(path, run_name="__main__")
    print(f"EXAMPLE-END {spec}", flush=True)
