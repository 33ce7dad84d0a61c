"""Plugin modules to copy from (docs/extending.md); a package, so that ``examples.*`` import paths
resolve to this folder from the repository root."""
