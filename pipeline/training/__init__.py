"""The DeepSpeed trainer: configuration (config, ds_config), pre-flight checks (preflight), the loop
(trainer), what a resume restores (state), the objectives' loss terms (objectives), checkpoints
(checkpoint), the Hugging Face export (hf_export), metrics and log lines (metrics, log)."""
