"""Numerical tolerances used by the tests, each with its reason, in one place."""

# amped promises bitwise identity with torch.autocast under the default policy:
# every comparison against torch.autocast uses these.
BITWISE = dict(rtol=0.0, atol=0.0, equal_nan=True)
