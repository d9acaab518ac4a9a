"""Training data: mixed, packed rows that resume exactly (packed), token shards (indexed,
prepared), the tokenizing job (prepare) and the tiny corpus (tinydata)."""
