"""``amped tune``: its command, progress display, table, plots and report page."""
