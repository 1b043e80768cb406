"""tilescale: distributed tile programming on stock TileLang."""
