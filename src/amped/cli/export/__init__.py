"""``amped export``: write a trained checkpoint in the inference format of its recipe."""
