"""Version of the package: the release it is (a tagged commit) or the last one it follows.

scripts/release sets it; scripts/build writes each build's own `__version__` from it and git (docs/releasing.md):
the release X.Y.Z on a clean commit tagged vX.Y.Z, a development version X.Y.(Z+1).dev0+g<commit> after it."""

__version__ = "1.0.0"
