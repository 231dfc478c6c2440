"""Version of the package. A source checkout only knows its API major (build.toml `version`); scripts/build replaces
this file in every build with the release's version, taken from the git tag (v1.2.0 -> "1.2.0"; docs/releasing.md)."""

__version__ = "1.x.dev"
