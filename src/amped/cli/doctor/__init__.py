"""``amped doctor``: its command and its page (``Report.save_html`` draws it too)."""
