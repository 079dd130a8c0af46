"""ml_collections configs: configs/<arch>/<task>.py, each `get_config(arg)` with a `:smoke` variant."""
