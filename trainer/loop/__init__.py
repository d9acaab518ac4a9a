"""The training loop (train), its health guards (health) and held-out evaluation (evaluate)."""
