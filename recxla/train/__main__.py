"""`python -m recxla.train`: see recxla.train.cli."""

from recxla.train.cli import entry

entry()
