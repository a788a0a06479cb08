"""``amped compare``: its command, progress display, table and report page."""
