"""A deterministic pure-torch backend implementing the whole generation interface."""

from gen_testkit.ngram.backend import NgramConfig, NgramGeneration
from gen_testkit.ngram.model import NgramModel

__all__ = ["NgramConfig", "NgramGeneration", "NgramModel"]
