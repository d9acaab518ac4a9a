"""The model and how it runs: layers (transformer), the parallel layout (parallel, pipeline),
the optimizer (optim), Hugging Face weights (hf), FLOP accounting (metrics) and the device
backends (backends picks one: eager, neuron)."""
