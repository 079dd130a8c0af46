"""Examples that use the zoo from outside it (not installed with the packages)."""
