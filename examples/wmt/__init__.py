"""A WMT-style encoder-decoder (the layout of flax's examples/wmt) with every attention built by
`zoo_core.attention.make`, trained on the number-words task and decoded through the 'cache' collection."""
