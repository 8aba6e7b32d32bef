"""Bayesian Model Merging (BMM) as mergekit merge methods.

Importing the package registers ``bmm`` with mergekit (installed wheels also do so at
start-up, so the stock ``mergekit-yaml`` knows it) and installs the model-card hook.
"""

from mergekit_bmm import card_hook
from mergekit_bmm.registration import register_all

__version__ = "0.1.0"
REGISTERED_METHODS = register_all()
card_hook.install()  # BMM merges get mergekit-bmm's model card (see card_hook)

__all__ = ["REGISTERED_METHODS", "__version__"]
