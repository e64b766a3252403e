"""Helpers the tests share: shard folders from our builder, the trainer launcher, tiny BERT folders, a real Slurm."""
