"""Sampling merged models around the MAP merge: the posterior of App. B and an i.i.d. baseline."""
