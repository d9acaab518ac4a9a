"""Checkpoints: the asynchronous checkpointer (checkpointer), shard names and retention
(ckpt_store), durable fast writes (store_write), the node-memory tier (memtier), and Hugging
Face conversion (convert)."""
