"""The deployable programs (source folders server/ and worker/ at the repository root)."""
