"""Experiments built on the product. Each folder is one study with its own README, configs and tests; it
runs the product's own commands and may import the core, while nothing outside pipeline/experiments/
imports from here, so a folder can be deleted once it has served."""
