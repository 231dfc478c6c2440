"""Version of the package as this tree holds it (PEP 440): what `import moe_dispatch` reports from a checkout.

X.Y.Z.dev0 on every commit but a release's, where X.Y.Z is the release CHANGELOG.md prepares (its entry headed
`## [X.Y.Z] - unreleased`; a minor release when the entry adds to the API under `### Added`). X.Y.Z in the release
commit scripts/release makes: it dates the entry, sets X.Y.Z here, then opens X.Y.(Z+1).dev0 in a second commit. A
build of the tree reports the same version, with `+g<commit>` added unless it is the tagged release (scripts/build;
docs/releasing.md, "Versions")."""

__version__ = "1.1.0.dev0"
