"""Task-level config pieces (datasets, splits, sizes) shared by the architecture configs."""
