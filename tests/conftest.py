"""What every test shares: the job runner and the test kernels on ``sys.path``.

- ``cpu_jobs`` (this folder): the one way tests start processes: ``run_cpu`` / ``tilescale_run``
  (jobs under ``tilescale run``), ``launch`` (a job watched while it runs), ``bare_ranks``
  (ranks started by hand), ``run_python`` (a script), all with ``clean_env``.
- ``shared_kernels`` (tests/ranks/): the kernel factories the rank programs and the lowering
  tests both use.
"""

import sys
from pathlib import Path

_TESTS = Path(__file__).resolve().parent
for _folder in (_TESTS, _TESTS / "ranks"):
    if str(_folder) not in sys.path:
        sys.path.insert(0, str(_folder))
