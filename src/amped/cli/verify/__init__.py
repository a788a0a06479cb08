"""``amped verify``: a backend's training step against amped's exact reference."""
