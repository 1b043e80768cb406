"""Rank program: start-up and shutdown only (the baseline of the CPU path's speed test)."""

import tilescale as ts
import tilescale.language  # noqa: F401  (the DSL, as the examples import it)
import tilescale.ops  # noqa: F401  (ts.ops loads on first use: the example uses it)

ts.init()
ts.finalize()
