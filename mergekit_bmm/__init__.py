"""Bayesian Model Merging (BMM) as mergekit merge methods.

Importing the package registers ``bmm`` with mergekit (installed wheels also do so at
start-up, so the stock ``mergekit-yaml`` knows it).
"""

from mergekit_bmm.registration import register_all

__version__ = "0.1.0"
REGISTERED_METHODS = register_all()

__all__ = ["REGISTERED_METHODS", "__version__"]
