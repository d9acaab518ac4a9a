"""The Trainium Operator: a kopf operator that runs TrainingRuns (see ARCHITECTURE.md section 4)."""

__version__ = "0.1.0"
