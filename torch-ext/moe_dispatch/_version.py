"""Version of the package: the last release this tree is or follows, X.Y.Z.

scripts/release sets it, and dates CHANGELOG.md's entry, in the release commit. scripts/build derives each build's own
`__version__` from these two records, git tags only confirming (docs/releasing.md): X.Y.Z on a clean commit tagged
vX.Y.Z, X.Y.(Z+1).dev0+g<commit> on any other commit after it, a clone without tags included."""

__version__ = "1.0.0"
