"""Training data: the shard folders (shards), BERT masking (masking), right padding (padding), the
masking collator (collator) and the streaming loader (loader)."""
