"""Raw English/Chinese corpora to mosaicml-streaming (MDS) shards, in parallel with Ray."""
