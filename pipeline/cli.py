"""The command-line conventions now live in preprocessing/cli.py (below both packages, so that the
shard builder shares them). This name stays only for pipeline/training/config.py, which imports it
under this name until its own owner switches that import; nothing else should."""

from preprocessing.cli import (  # noqa: F401
    add_arguments,
    knob,
    load_config_file,
    math_changes,
    merge_sections,
    missing_required,
    operational_changes,
    set_values,
)
