"""``python -m tilescale.launch run ...``: the same as the ``tilescale`` console script."""

from tilescale.launch.cli import main

raise SystemExit(main())
