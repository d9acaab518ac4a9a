"""The object store's start-up reads: which errors are transient and the retry (errors), one
reader per node (node_reads)."""
