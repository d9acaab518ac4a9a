"""STAND-IN (tests/standins/README.md)."""
