"""The Trainium Operator: a kopf operator that runs TrainingRuns (see docs/architecture.md, section 2)."""

__version__ = "0.1.0"
