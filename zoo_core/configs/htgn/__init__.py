"""Configs of HTGN (`python -m htgn_jax.train --config configs/htgn/<file>.py[:args]`); the pieces they
share are in configs/htgn/common.py."""
